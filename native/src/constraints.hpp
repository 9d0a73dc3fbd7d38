// Constraint automata and the per-row state machine behind modelops_native.
//
// Vocabulary masks are packed bitmasks: words = ceil(vocab / 32) uint32 per row, bit (t & 31) of
// word (t >> 5) set <=> token t allowed (the layout xgrammar and vLLM use).
//
// A Program is a sequence of segments; a segment repeats one leaf automaton (a catalog trie or a
// token DFA) between min and max times, with an optional separator token sequence between items
// and, for catalogs, an optional "no item twice" rule. A single catalog or DFA is one segment with
// min = max = 1. Programs are immutable after construction and shared between rows and threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mo {

// A set of token ids: a sorted list when small, a packed bitmap when dense (cheaper to OR in).
struct TokenSet {
  std::vector<int32_t> tokens;  // sorted, unique; emptied when `dense` is used
  std::vector<uint32_t> dense;  // `words` words, or empty
  int64_t count = 0;

  static TokenSet make(std::vector<int32_t> sorted_unique, int32_t words);
  bool contains(int32_t t) const;
  void or_into(uint32_t* row) const;
  size_t bytes() const { return tokens.capacity() * 4 + dense.capacity() * 4 + sizeof(*this); }
};

// Catalog: a token trie over N items, nodes in depth-first pre-order (node 0 is the root), so a
// node's subtree is the id range [node, subtree_end[node]) and an item is its terminal node id.
struct Catalog {
  std::vector<int32_t> edge_begin;   // n_nodes + 1: edges of node n are [edge_begin[n], edge_begin[n+1])
  std::vector<int32_t> label;        // n_edges, ascending within a node
  std::vector<int32_t> target;       // n_edges, ascending within a node (pre-order)
  std::vector<int32_t> subtree_end;  // n_nodes
  std::vector<int32_t> n_items;      // n_nodes: terminal nodes in the subtree
  std::vector<uint64_t> terminal;    // bitset over nodes
  std::vector<int32_t> dense_nodes;  // sorted node ids with many children ...
  std::vector<uint32_t> dense_words; // ... and their child masks, `words` words each
  int32_t words = 0;
  int64_t n_unique_items = 0;

  int32_t n_nodes() const { return static_cast<int32_t>(subtree_end.size()); }
  int64_t n_edges() const { return static_cast<int64_t>(label.size()); }
  bool is_terminal(int32_t n) const { return (terminal[n >> 6] >> (n & 63)) & 1; }
  int32_t child(int32_t node, int32_t tok) const;
  void fill_children(int32_t node, uint32_t* row) const;
  size_t bytes() const;
};

// DFA over tokens: per state, transitions (token set -> next state); sets are disjoint per state.
struct Dfa {
  int32_t start = 0;
  std::vector<TokenSet> sets;
  std::vector<int32_t> trans_begin;  // n_states + 1
  std::vector<int32_t> trans_set;    // set index per transition
  std::vector<int32_t> trans_next;   // next state per transition
  std::vector<uint8_t> accepting;

  int32_t next(int32_t s, int32_t tok) const;
  void fill(int32_t s, uint32_t* row) const;
  size_t bytes() const;
};

struct Leaf {
  enum Kind : int32_t { kCatalog = 0, kDfa = 1 };
  Kind kind;
  int32_t words = 0;  // of the vocabulary it was compiled for
  Catalog cat;
  Dfa dfa;

  int32_t start() const { return kind == kCatalog ? 0 : dfa.start; }
  bool accepts(int32_t s) const { return kind == kCatalog ? cat.is_terminal(s) : dfa.accepting[s] != 0; }
  size_t bytes() const { return kind == kCatalog ? cat.bytes() : dfa.bytes(); }
  // Tokens that continue from an accepting state (for the ambiguity check), as a bitmap.
  std::vector<uint32_t> accept_out() const;
  std::vector<uint32_t> first() const;  // tokens that can start an item
};

// Builders; throw std::invalid_argument with a message naming the field.
std::shared_ptr<Leaf> build_catalog(const int32_t* tokens, const int64_t* offsets, int64_t n_items,
                                    int32_t vocab, int64_t dense_min_children);
std::shared_ptr<Leaf> build_dfa(int32_t n_states, int32_t start, const std::vector<int32_t>& accepting,
                                const std::vector<std::vector<int32_t>>& sets, const int32_t* transitions,
                                int64_t n_transitions, int32_t vocab);

struct Segment {
  std::shared_ptr<const Leaf> leaf;
  int32_t min = 1, max = 1;
  std::vector<int32_t> sep;
  bool unique = false;
  std::string path;  // for error messages, e.g. "parts[1]"
};

// Most items a "unique" segment may hold: bounds the per-row state (used item list).
constexpr int32_t kMaxUniqueItems = 192;

struct Program {
  std::vector<Segment> segs;
  int32_t vocab = 0, words = 0;

  // Validates (separator ids, nullable items, ambiguity between continuing an item and what may
  // follow it); throws std::invalid_argument naming the segment.
  Program(std::vector<Segment> segments, int32_t vocab);
  size_t bytes() const;
};

struct RowState {
  enum Phase : uint8_t { kItem = 0, kSep = 1, kDead = 2 };
  int32_t seg = 0, count = 0, leaf = 0, sep_pos = 0;
  Phase phase = kItem;
  std::vector<int32_t> used;  // sorted terminal ids of items already emitted (unique segments)

  size_t bytes() const { return sizeof(*this) + used.capacity() * 4; }
};

RowState initial_state(const Program& p);
// Consumes one token; returns false (state becomes dead) when the token is not allowed.
bool step(const Program& p, RowState& s, int32_t tok);
// Writes the row's allowed-token mask (all `words` words) and returns whether the state accepts.
// EOS ids get their bit set exactly when the state accepts; a dead state allows only EOS.
bool fill_mask(const Program& p, const RowState& s, const int32_t* eos, int n_eos, uint32_t* row);
bool accepts(const Program& p, const RowState& s);

}  // namespace mo
