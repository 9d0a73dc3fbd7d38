#include "constraints.hpp"
#include "clones.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <stdexcept>

namespace mo {


namespace {

// Word-wise OR of a ready mask into a row (dense catalog nodes, dense DFA sets).
MO_CLONES void or_words(uint32_t* __restrict row, const uint32_t* __restrict src, int64_t n) {
  for (int64_t w = 0; w < n; ++w) row[w] |= src[w];
}

inline void set_bit(uint32_t* row, int32_t t) { row[t >> 5] |= 1u << (t & 31); }
inline void clear_bit(uint32_t* row, int32_t t) { row[t >> 5] &= ~(1u << (t & 31)); }
inline int32_t words_for(int32_t vocab) { return (vocab + 31) / 32; }

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

void check_token(int32_t t, int32_t vocab, const std::string& where) {
  if (t < 0 || t >= vocab)
    fail(where + ": token id " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

const std::vector<int32_t> kNoneUsed;

// Items of `used` (sorted) plus `extra` (or -1) that lie in [lo, hi).
int32_t count_in(const std::vector<int32_t>& used, int32_t extra, int32_t lo, int32_t hi) {
  auto a = std::lower_bound(used.begin(), used.end(), lo);
  auto b = std::lower_bound(a, used.end(), hi);
  return static_cast<int32_t>(b - a) + (extra >= lo && extra < hi ? 1 : 0);
}

// Next state of a segment's leaf, honouring the "no item twice" rule: a catalog edge whose
// subtree holds only used items is closed. -1 when not allowed.
int32_t leaf_next(const Segment& g, const std::vector<int32_t>& used, int32_t extra, int32_t node, int32_t t) {
  const Leaf& leaf = *g.leaf;
  if (leaf.kind == Leaf::kDfa) return leaf.dfa.next(node, t);
  const Catalog& c = leaf.cat;
  int32_t nx = c.child(node, t);
  if (nx < 0 || !g.unique) return nx;
  return count_in(used, extra, nx, c.subtree_end[nx]) >= c.n_items[nx] ? -1 : nx;
}

void leaf_fill(const Segment& g, const std::vector<int32_t>& used, int32_t extra, int32_t node, uint32_t* row) {
  const Leaf& leaf = *g.leaf;
  if (leaf.kind == Leaf::kDfa) {
    leaf.dfa.fill(node, row);
    return;
  }
  const Catalog& c = leaf.cat;
  c.fill_children(node, row);
  if (!g.unique || (used.empty() && extra < 0)) return;
  // Used items strictly below `node`, merged with `extra`, grouped by the child holding them.
  const int32_t lo = node + 1, hi = c.subtree_end[node];
  std::array<int32_t, kMaxUniqueItems + 1> buf;
  int32_t m = 0;
  auto it = std::lower_bound(used.begin(), used.end(), lo);
  bool extra_pending = extra >= lo && extra < hi;
  for (; it != used.end() && *it < hi; ++it) {
    if (extra_pending && extra < *it) {
      buf[m++] = extra;
      extra_pending = false;
    }
    buf[m++] = *it;
  }
  if (extra_pending) buf[m++] = extra;
  const int32_t* tb = c.target.data() + c.edge_begin[node];
  const int32_t* te = c.target.data() + c.edge_begin[node + 1];
  for (int32_t i = 0; i < m;) {
    const int32_t* e = std::upper_bound(tb, te, buf[i]) - 1;  // the child whose subtree holds buf[i]
    const int32_t ch = *e;
    int32_t j = static_cast<int32_t>(std::lower_bound(buf.begin() + i, buf.begin() + m, c.subtree_end[ch]) - buf.begin());
    if (j - i >= c.n_items[ch]) clear_bit(row, c.label[e - c.target.data()]);
    i = j;
  }
}

bool item_complete(const Segment& g, const RowState& s) {
  if (!g.leaf->accepts(s.leaf)) return false;
  return !(g.unique && std::binary_search(s.used.begin(), s.used.end(), s.leaf));
}

void commit_item(const Segment& g, RowState& s) {
  if (!g.unique) return;
  if (s.used.capacity() < static_cast<size_t>(g.max)) s.used.reserve(g.max);  // one allocation, bounded by max
  s.used.insert(std::upper_bound(s.used.begin(), s.used.end(), s.leaf), s.leaf);
}

bool intersects(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b, int32_t* tok) {
  for (size_t w = 0; w < a.size(); ++w) {
    uint32_t x = a[w] & b[w];
    if (x) {
      *tok = static_cast<int32_t>(w * 32 + __builtin_ctz(x));
      return true;
    }
  }
  return false;
}

}  // namespace

// ---- TokenSet ---------------------------------------------------------------------------------

TokenSet TokenSet::make(std::vector<int32_t> sorted_unique, int32_t words) {
  TokenSet s;
  s.count = static_cast<int64_t>(sorted_unique.size());
  // Dense when ORing `words` words is cheaper than setting `count` bits one by one.
  if (s.count > words) {
    s.dense.assign(words, 0);
    for (int32_t t : sorted_unique) set_bit(s.dense.data(), t);
  } else {
    s.tokens = std::move(sorted_unique);
    s.tokens.shrink_to_fit();
  }
  return s;
}

bool TokenSet::contains(int32_t t) const {
  if (!dense.empty()) return t >= 0 && (t >> 5) < static_cast<int32_t>(dense.size()) && ((dense[t >> 5] >> (t & 31)) & 1);
  return std::binary_search(tokens.begin(), tokens.end(), t);
}

void TokenSet::or_into(uint32_t* row) const {
  if (!dense.empty()) {
    or_words(row, dense.data(), static_cast<int64_t>(dense.size()));
  } else {
    for (int32_t t : tokens) set_bit(row, t);
  }
}

// ---- Catalog ----------------------------------------------------------------------------------

int32_t Catalog::child(int32_t node, int32_t tok) const {
  const int32_t* b = label.data() + edge_begin[node];
  const int32_t* e = label.data() + edge_begin[node + 1];
  const int32_t* it = std::lower_bound(b, e, tok);
  return (it != e && *it == tok) ? target[it - label.data()] : -1;
}

void Catalog::fill_children(int32_t node, uint32_t* row) const {
  const int32_t b = edge_begin[node], e = edge_begin[node + 1];
  if (e - b == 0) return;
  if (!dense_nodes.empty()) {
    auto it = std::lower_bound(dense_nodes.begin(), dense_nodes.end(), node);
    if (it != dense_nodes.end() && *it == node) {
      or_words(row, dense_words.data() + static_cast<size_t>(it - dense_nodes.begin()) * words, words);
      return;
    }
  }
  const int32_t* l = label.data();
  for (int32_t i = b; i < e; ++i) set_bit(row, l[i]);
}

size_t Catalog::bytes() const {
  return sizeof(*this) + 4 * (edge_begin.capacity() + label.capacity() + target.capacity() + subtree_end.capacity() +
                              n_items.capacity() + dense_nodes.capacity() + dense_words.capacity()) +
         8 * terminal.capacity();
}

std::shared_ptr<Leaf> build_catalog(const int32_t* tokens, const int64_t* offsets, int64_t n_items, int32_t vocab,
                                    int64_t dense_min_children) {
  if (vocab <= 0) fail("vocab_size must be positive");
  if (n_items <= 0) fail("items: a catalog needs at least one item");
  for (int64_t i = 0; i < n_items; ++i) {
    if (offsets[i + 1] < offsets[i]) fail("items: offsets are not ascending");
    for (int64_t k = offsets[i]; k < offsets[i + 1]; ++k)
      check_token(tokens[k], vocab, "items[" + std::to_string(i) + "][" + std::to_string(k - offsets[i]) + "]");
  }
  std::vector<int64_t> order(n_items);
  std::iota(order.begin(), order.end(), 0);
  auto less = [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(tokens + offsets[a], tokens + offsets[a + 1], tokens + offsets[b],
                                        tokens + offsets[b + 1]);
  };
  std::sort(order.begin(), order.end(), less);

  auto leaf = std::make_shared<Leaf>();
  leaf->kind = Leaf::kCatalog;
  leaf->words = words_for(vocab);
  Catalog& c = leaf->cat;
  c.words = words_for(vocab);
  // Nodes are numbered in creation order, which on lexicographically sorted items is pre-order.
  std::vector<int32_t> parent{-1}, subtree_end{0}, edge_parent, edge_label, edge_target;
  std::vector<uint8_t> term{0};
  std::vector<int32_t> path{0};
  int64_t prev = -1;
  auto close_to = [&](size_t depth) {
    while (path.size() > depth + 1) {
      subtree_end[path.back()] = static_cast<int32_t>(parent.size());
      path.pop_back();
    }
  };
  for (int64_t idx : order) {
    const int32_t* it = tokens + offsets[idx];
    const int64_t len = offsets[idx + 1] - offsets[idx];
    int64_t lcp = 0;
    if (prev >= 0) {
      const int32_t* pt = tokens + offsets[prev];
      const int64_t plen = offsets[prev + 1] - offsets[prev];
      while (lcp < len && lcp < plen && pt[lcp] == it[lcp]) ++lcp;
      if (lcp == len && lcp == plen) continue;  // duplicate item
    }
    prev = idx;
    close_to(static_cast<size_t>(lcp));
    for (int64_t k = lcp; k < len; ++k) {
      if (parent.size() >= static_cast<size_t>(INT32_MAX)) fail("items: the catalog trie exceeds 2^31 nodes");
      const int32_t id = static_cast<int32_t>(parent.size());
      parent.push_back(path.back());
      subtree_end.push_back(0);
      term.push_back(0);
      edge_parent.push_back(path.back());
      edge_label.push_back(it[k]);
      edge_target.push_back(id);
      path.push_back(id);
    }
    term[path.back()] = 1;
    ++c.n_unique_items;
  }
  close_to(0);
  subtree_end[0] = static_cast<int32_t>(parent.size());

  const int32_t n_nodes = static_cast<int32_t>(parent.size());
  c.subtree_end = std::move(subtree_end);
  c.subtree_end.shrink_to_fit();
  c.n_items.assign(n_nodes, 0);
  c.terminal.assign((n_nodes + 63) / 64, 0);
  for (int32_t n = n_nodes - 1; n >= 0; --n) {
    if (term[n]) {
      c.n_items[n] += 1;
      c.terminal[n >> 6] |= uint64_t(1) << (n & 63);
    }
    if (parent[n] >= 0) c.n_items[parent[n]] += c.n_items[n];
  }
  // CSR by parent; a stable counting sort keeps each node's edges in ascending label order.
  c.edge_begin.assign(n_nodes + 1, 0);
  for (int32_t p : edge_parent) ++c.edge_begin[p + 1];
  for (int32_t n = 0; n < n_nodes; ++n) c.edge_begin[n + 1] += c.edge_begin[n];
  const size_t n_edges = edge_parent.size();
  c.label.resize(n_edges);
  c.target.resize(n_edges);
  std::vector<int32_t> fill_at(c.edge_begin.begin(), c.edge_begin.end() - 1);
  for (size_t e = 0; e < n_edges; ++e) {
    const int32_t pos = fill_at[edge_parent[e]]++;
    c.label[pos] = edge_label[e];
    c.target[pos] = edge_target[e];
  }
  // Nodes with many children get a ready-made child mask: one pass of ORs instead of k bit sets.
  const int64_t threshold = std::max<int64_t>(1, dense_min_children);
  for (int32_t n = 0; n < n_nodes; ++n) {
    if (c.edge_begin[n + 1] - c.edge_begin[n] >= threshold) {
      c.dense_nodes.push_back(n);
      const size_t base = c.dense_words.size();
      c.dense_words.resize(base + c.words, 0);
      for (int32_t i = c.edge_begin[n]; i < c.edge_begin[n + 1]; ++i) set_bit(c.dense_words.data() + base, c.label[i]);
    }
  }
  c.dense_nodes.shrink_to_fit();
  c.dense_words.shrink_to_fit();
  return leaf;
}

// ---- DFA --------------------------------------------------------------------------------------

int32_t Dfa::next(int32_t s, int32_t tok) const {
  for (int32_t i = trans_begin[s]; i < trans_begin[s + 1]; ++i)
    if (sets[trans_set[i]].contains(tok)) return trans_next[i];
  return -1;
}

void Dfa::fill(int32_t s, uint32_t* row) const {
  for (int32_t i = trans_begin[s]; i < trans_begin[s + 1]; ++i) sets[trans_set[i]].or_into(row);
}

size_t Dfa::bytes() const {
  size_t b = sizeof(*this) + 4 * (trans_begin.capacity() + trans_set.capacity() + trans_next.capacity()) +
             accepting.capacity();
  for (const auto& s : sets) b += s.bytes();
  return b;
}

std::shared_ptr<Leaf> build_dfa(int32_t n_states, int32_t start, const std::vector<int32_t>& accepting,
                                const std::vector<std::vector<int32_t>>& sets, const int32_t* transitions,
                                int64_t n_transitions, int32_t vocab) {
  if (vocab <= 0) fail("vocab_size must be positive");
  if (n_states <= 0) fail("num_states: a DFA needs at least one state");
  if (start < 0 || start >= n_states) fail("start: state " + std::to_string(start) + " is not in [0, num_states)");
  const int32_t words = words_for(vocab);
  const int32_t n_sets = static_cast<int32_t>(sets.size());
  for (int32_t i = 0; i < n_sets; ++i) {
    for (size_t k = 0; k < sets[i].size(); ++k) {
      check_token(sets[i][k], vocab, "sets[" + std::to_string(i) + "]");
      if (k && sets[i][k] <= sets[i][k - 1]) fail("sets[" + std::to_string(i) + "]: token ids must be sorted and unique");
    }
  }
  std::vector<uint8_t> acc(n_states, 0);
  for (int32_t a : accepting) {
    if (a < 0 || a >= n_states) fail("accepting: state " + std::to_string(a) + " is not in [0, num_states)");
    acc[a] = 1;
  }
  // Group transitions by source state (stable), validating as we go.
  std::vector<int32_t> begin(n_states + 1, 0);
  for (int64_t i = 0; i < n_transitions; ++i) {
    const int32_t s = transitions[3 * i], set = transitions[3 * i + 1], nx = transitions[3 * i + 2];
    const std::string where = "transitions[" + std::to_string(i) + "]";
    if (s < 0 || s >= n_states) fail(where + ": state " + std::to_string(s) + " is not in [0, num_states)");
    if (set < 0 || set >= n_sets) fail(where + ": set " + std::to_string(set) + " is not in [0, len(sets))");
    if (nx < 0 || nx >= n_states) fail(where + ": next state " + std::to_string(nx) + " is not in [0, num_states)");
    ++begin[s + 1];
  }
  for (int32_t s = 0; s < n_states; ++s) begin[s + 1] += begin[s];
  std::vector<int32_t> t_set(n_transitions), t_next(n_transitions), t_src(n_transitions), at(begin.begin(), begin.end() - 1);
  for (int64_t i = 0; i < n_transitions; ++i) {
    const int32_t pos = at[transitions[3 * i]]++;
    t_set[pos] = transitions[3 * i + 1];
    t_next[pos] = transitions[3 * i + 2];
    t_src[pos] = transitions[3 * i];
  }
  // Determinism: the sets leaving one state must be disjoint.
  std::vector<uint32_t> seen(words, 0);
  std::vector<int32_t> owner(vocab, -1);
  for (int32_t s = 0; s < n_states; ++s) {
    for (int32_t i = begin[s]; i < begin[s + 1]; ++i) {
      for (int32_t t : sets[t_set[i]]) {
        if ((seen[t >> 5] >> (t & 31)) & 1)
          fail("transitions: state " + std::to_string(s) + " has token " + std::to_string(t) + " in two sets (" +
               std::to_string(owner[t]) + " and " + std::to_string(t_set[i]) + "); a DFA must be deterministic");
        set_bit(seen.data(), t);
        owner[t] = t_set[i];
      }
    }
    for (int32_t i = begin[s]; i < begin[s + 1]; ++i)
      for (int32_t t : sets[t_set[i]]) clear_bit(seen.data(), t);
  }
  // Trim: keep only transitions into states from which an accepting state is reachable, so every
  // allowed token can still end in acceptance.
  std::vector<uint8_t> live(acc);
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t i = 0; i < static_cast<int32_t>(n_transitions); ++i)
      if (!live[t_src[i]] && live[t_next[i]] && !sets[t_set[i]].empty()) live[t_src[i]] = changed = 1;
  }
  if (!live[start]) fail("accepting: no accepting state is reachable from the start state");

  auto leaf = std::make_shared<Leaf>();
  leaf->kind = Leaf::kDfa;
  leaf->words = words;
  Dfa& d = leaf->dfa;
  d.start = start;
  d.accepting = std::move(acc);
  for (const auto& s : sets) d.sets.push_back(TokenSet::make(s, words));
  d.trans_begin.assign(n_states + 1, 0);
  for (int32_t s = 0; s < n_states; ++s) {
    for (int32_t i = begin[s]; i < begin[s + 1]; ++i) {
      if (!live[t_next[i]] || sets[t_set[i]].empty()) continue;
      d.trans_set.push_back(t_set[i]);
      d.trans_next.push_back(t_next[i]);
    }
    d.trans_begin[s + 1] = static_cast<int32_t>(d.trans_set.size());
  }
  d.trans_set.shrink_to_fit();
  d.trans_next.shrink_to_fit();
  return leaf;
}

// ---- Leaf helpers -----------------------------------------------------------------------------

std::vector<uint32_t> Leaf::accept_out() const {
  std::vector<uint32_t> out(words, 0);
  if (kind == kCatalog) {
    for (int32_t n = 0; n < cat.n_nodes(); ++n)
      if (cat.is_terminal(n)) cat.fill_children(n, out.data());
  } else {
    for (size_t s = 0; s < dfa.accepting.size(); ++s)
      if (dfa.accepting[s]) dfa.fill(static_cast<int32_t>(s), out.data());
  }
  return out;
}

std::vector<uint32_t> Leaf::first() const {
  std::vector<uint32_t> out(words, 0);
  if (kind == kCatalog) cat.fill_children(0, out.data());
  else dfa.fill(dfa.start, out.data());
  return out;
}

// ---- Program ----------------------------------------------------------------------------------

Program::Program(std::vector<Segment> segments, int32_t vocab_size) : segs(std::move(segments)), vocab(vocab_size) {
  if (vocab <= 0) fail("vocab_size must be positive");
  if (segs.empty()) fail("parts: a sequence needs at least one part");
  words = words_for(vocab);
  const size_t n = segs.size();
  for (size_t i = 0; i < n; ++i) {
    const Segment& g = segs[i];
    if (!g.leaf) fail(g.path + ": missing constraint");
    if (g.leaf->words != words) fail(g.path + ": the constraint was compiled for another vocabulary size");
    if (g.min < 1 || g.max < g.min) fail(g.path + ": need 1 <= min <= max, got min=" + std::to_string(g.min) +
                                         " max=" + std::to_string(g.max));
    for (size_t k = 0; k < g.sep.size(); ++k) check_token(g.sep[k], vocab, g.path + ".separator[" + std::to_string(k) + "]");
    if (g.unique) {
      if (g.leaf->kind != Leaf::kCatalog) fail(g.path + ".unique: only catalog items can be required to differ");
      if (g.max > kMaxUniqueItems)
        fail(g.path + ".max: at most " + std::to_string(kMaxUniqueItems) + " items when unique is set, got " +
             std::to_string(g.max));
      if (g.min > g.leaf->cat.n_unique_items)
        fail(g.path + ".min: " + std::to_string(g.min) + " distinct items requested, the catalog has " +
             std::to_string(g.leaf->cat.n_unique_items));
    }
    if (g.leaf->accepts(g.leaf->start()) && (n > 1 || g.max > 1))
      fail(g.path + ": the empty sequence is an item; only a single constraint (no sequence, no repeat) may accept it");
  }
  // Determinism at item boundaries: after a complete item the next token must tell apart
  // "continue the item", "separator / next item" and "next part".
  for (size_t i = 0; i < n; ++i) {
    const Segment& g = segs[i];
    const std::vector<uint32_t> cont = g.leaf->accept_out();
    std::vector<uint32_t> again(words, 0), next(words, 0);
    if (g.max > 1) {
      if (!g.sep.empty()) set_bit(again.data(), g.sep[0]);
      else again = g.leaf->first();
    }
    if (i + 1 < n) next = segs[i + 1].leaf->first();
    int32_t t = -1;
    if (intersects(cont, again, &t))
      fail(g.path + ": token " + std::to_string(t) + " can both continue an item and start " +
           (g.sep.empty() ? "the next item" : "the separator") + "; the constraint would be ambiguous");
    if (intersects(cont, next, &t))
      fail(g.path + ": token " + std::to_string(t) + " can both continue an item and start " + segs[i + 1].path +
           "; the constraint would be ambiguous");
    if (g.min < g.max && intersects(again, next, &t))
      fail(g.path + ": token " + std::to_string(t) + " can both start another item and start " + segs[i + 1].path +
           "; the constraint would be ambiguous");
  }
}

size_t Program::bytes() const {
  size_t b = sizeof(*this);
  for (const auto& g : segs) b += sizeof(g) + g.sep.capacity() * 4 + g.path.capacity();
  return b;
}

// ---- Row state machine ------------------------------------------------------------------------

RowState initial_state(const Program& p) {
  RowState s;
  s.leaf = p.segs[0].leaf->start();
  return s;
}

bool accepts(const Program& p, const RowState& s) {
  if (s.phase != RowState::kItem) return false;
  const Segment& g = p.segs[s.seg];
  return s.seg + 1 == static_cast<int32_t>(p.segs.size()) && s.count + 1 >= g.min && item_complete(g, s);
}

bool step(const Program& p, RowState& s, int32_t t) {
  if (s.phase == RowState::kDead) return false;
  const Segment& g = p.segs[s.seg];
  if (s.phase == RowState::kSep) {
    if (t != g.sep[s.sep_pos]) {
      s.phase = RowState::kDead;
      return false;
    }
    if (++s.sep_pos == static_cast<int32_t>(g.sep.size())) {
      s.phase = RowState::kItem;
      s.sep_pos = 0;
      s.leaf = g.leaf->start();
    }
    return true;
  }
  int32_t nx = leaf_next(g, s.used, -1, s.leaf, t);
  if (nx >= 0) {
    s.leaf = nx;
    return true;
  }
  if (item_complete(g, s)) {
    const int32_t c1 = s.count + 1;
    if (c1 < g.max) {
      if (!g.sep.empty()) {
        if (t == g.sep[0]) {
          commit_item(g, s);
          s.count = c1;
          if (g.sep.size() == 1) s.leaf = g.leaf->start();
          else s.phase = RowState::kSep, s.sep_pos = 1;
          return true;
        }
      } else if ((nx = leaf_next(g, s.used, s.leaf, g.leaf->start(), t)) >= 0) {
        commit_item(g, s);
        s.count = c1;
        s.leaf = nx;
        return true;
      }
    }
    if (c1 >= g.min && s.seg + 1 < static_cast<int32_t>(p.segs.size())) {
      const Segment& h = p.segs[s.seg + 1];
      if ((nx = leaf_next(h, kNoneUsed, -1, h.leaf->start(), t)) >= 0) {
        s.seg += 1;
        s.count = 0;
        s.used.clear();
        s.leaf = nx;
        return true;
      }
    }
  }
  s.phase = RowState::kDead;
  return false;
}

bool fill_mask(const Program& p, const RowState& s, const int32_t* eos, int n_eos, uint32_t* row) {
  std::memset(row, 0, sizeof(uint32_t) * p.words);
  bool acc = false;
  if (s.phase == RowState::kSep) {
    set_bit(row, p.segs[s.seg].sep[s.sep_pos]);
  } else if (s.phase == RowState::kItem) {
    const Segment& g = p.segs[s.seg];
    leaf_fill(g, s.used, -1, s.leaf, row);
    if (item_complete(g, s)) {
      const int32_t c1 = s.count + 1;
      if (c1 < g.max) {
        if (!g.sep.empty()) set_bit(row, g.sep[0]);
        else leaf_fill(g, s.used, s.leaf, g.leaf->start(), row);
      }
      if (c1 >= g.min) {
        if (s.seg + 1 < static_cast<int32_t>(p.segs.size())) {
          const Segment& h = p.segs[s.seg + 1];
          leaf_fill(h, kNoneUsed, -1, h.leaf->start(), row);
        } else {
          acc = true;
        }
      }
    }
  }
  // A dead state (its history already broke the rule) can only end; EOS is its one way out.
  const bool eos_on = acc || s.phase == RowState::kDead;
  for (int i = 0; i < n_eos; ++i) {
    if (eos_on) set_bit(row, eos[i]);
    else clear_bit(row, eos[i]);
  }
  return acc;
}

}  // namespace mo
