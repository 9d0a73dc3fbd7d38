// pybind11 bindings: modelops_native._engine. Only modelops_native/_native.py imports this module.
//
// Arrays cross the boundary through the buffer protocol (numpy or anything alike), so the
// extension links neither numpy nor torch and the same build serves both environments.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "constraints.hpp"
#include "kernels.hpp"
#include "thread_pool.hpp"

namespace py = pybind11;
using namespace mo;

namespace {

template <typename T>
const T* vector_buffer(const py::buffer& b, const char* name, int64_t* n) {
  py::buffer_info info = b.request();
  if (info.ndim != 1) throw std::invalid_argument(std::string(name) + " must be one-dimensional");
  if (info.itemsize != sizeof(T)) throw std::invalid_argument(std::string(name) + " has the wrong item size");
  if (info.shape[0] > 1 && info.strides[0] != static_cast<py::ssize_t>(sizeof(T)))
    throw std::invalid_argument(std::string(name) + " must be contiguous");
  *n = info.shape[0];
  return static_cast<const T*>(info.ptr);
}

// One batch row: its constraint, automaton state and the history it was derived from.
struct Row {
  std::shared_ptr<const Program> prog;
  RowState st;
  std::vector<int32_t> eos;  // EOS and stop ids: allowed exactly when the state accepts (any number)
  PyObject* hist = nullptr;  // owned reference to the live output-token list
  int64_t consumed = 0;      // tokens of `hist` the state has consumed
  int32_t last = -1;         // hist[consumed - 1] when consumed > 0

  void release() {
    Py_XDECREF(hist);
    hist = nullptr;
  }
};

// The per-process engine: rows indexed like the model runner's persistent batch.
class Batch {
 public:
  Batch(int32_t vocab, int num_threads) : vocab_(vocab), words_((vocab + 31) / 32), pool_(num_threads) {
    if (vocab <= 0) throw std::invalid_argument("vocab_size must be positive, got " + std::to_string(vocab));
    if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  ~Batch() {
    for (auto& r : rows_) r.release();
  }

  int32_t vocab() const { return vocab_; }
  int32_t words() const { return words_; }
  int threads() const { return pool_.size(); }
  int64_t capacity() const { return static_cast<int64_t>(rows_.size()); }
  int64_t replays() const { return replays_; }

  void add(int64_t i, std::shared_ptr<const Program> prog, const std::vector<int32_t>& eos, py::object history) {
    if (prog->vocab != vocab_)
      throw std::invalid_argument("constraint compiled for vocab_size " + std::to_string(prog->vocab) +
                                  ", batch has " + std::to_string(vocab_));
    for (int32_t e : eos)
      if (e < 0 || e >= vocab_) throw std::invalid_argument("EOS id " + std::to_string(e) + " is outside the vocabulary");
    Row& r = row(i);
    r.release();
    r.prog = std::move(prog);
    r.eos = eos;
    r.hist = history.is_none() ? nullptr : history.inc_ref().ptr();
    restart(r);
    try {
      sync_row(r);
    } catch (...) {
      // A history that cannot be read (not a list of ints) leaves no row behind: a later
      // sync() must not raise for it again.
      r.release();
      r = Row();
      throw;
    }
  }

  void remove(int64_t i) {
    if (i < 0) throw std::out_of_range("row index must be >= 0");
    if (i >= capacity()) return;
    Row& r = rows_[i];
    r.release();
    r = Row();
  }

  // One-way move: dst takes src's row, src becomes empty.
  void move(int64_t src, int64_t dst) {
    row(std::max(src, dst));  // grow first: references taken below must stay valid
    if (src == dst) return;
    Row& a = row(src);
    Row& b = row(dst);
    b.release();
    b = std::move(a);
    a.hist = nullptr;
    a = Row();
  }

  void swap(int64_t i, int64_t j) {
    row(std::max(i, j));
    Row& a = row(i);
    Row& b = row(j);
    std::swap(a, b);
  }

  // Brings every row's state up to its history. Returns how many rows had to start over.
  int64_t sync() {
    int64_t restarted = 0;
    for (auto& r : rows_)
      if (r.prog && r.hist) restarted += sync_row(r);
    return restarted;
  }

  // Consumes explicit tokens (rows without a history list: benchmarks, direct use).
  bool advance(int64_t i, const std::vector<int32_t>& tokens) {
    Row& r = existing(i);
    for (int32_t t : tokens) {
      step(*r.prog, r.st, t);
      r.last = t;
      ++r.consumed;
    }
    return r.st.phase != RowState::kDead;
  }

  void reset(int64_t i) {
    Row& r = existing(i);
    restart(r);
  }

  bool has(int64_t i) const { return i >= 0 && i < capacity() && rows_[i].prog != nullptr; }
  bool accepts_row(int64_t i) { Row& r = existing(i); return accepts(*r.prog, r.st); }
  bool dead(int64_t i) { return existing(i).st.phase == RowState::kDead; }
  int64_t consumed(int64_t i) { return existing(i).consumed; }
  size_t state_bytes(int64_t i) {
    const Row& r = existing(i);
    return sizeof(Row) + (r.st.used.capacity() + r.eos.capacity()) * 4;
  }

  // Fills rows [0, n_rows) of `out` (uint32/int32 [>= n_rows, words]); rows without a constraint
  // allow every token. Runs on the pool; the caller has released the GIL.
  void fill(uint32_t* out, int64_t n_rows, int64_t stride) {
    const int64_t grain = std::max<int64_t>(1, kWorkPerChunk / std::max<int32_t>(words_, 1));
    pool_.parallel_for(n_rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) fill_row(i, out + i * stride);
    });
  }

  void apply(void* logits, int dtype, int64_t n_rows, int64_t cols, int64_t row_stride, const uint32_t* mask,
             int64_t mask_stride) {
    const int64_t grain = std::max<int64_t>(1, 32 * kWorkPerChunk / std::max<int64_t>(cols, 1));
    pool_.parallel_for(n_rows, grain, [&](int64_t b, int64_t e) {
      apply_rows(logits, dtype, b, e, cols, row_stride, mask, mask_stride);
    });
  }

 private:
  // Rows per chunk are sized to about this many mask words: small batches run inline (a pool
  // hand-off costs more than they do), large ones spread over the threads.
  static constexpr int64_t kWorkPerChunk = 8192;

  Row& row(int64_t i) {
    if (i < 0) throw std::out_of_range("row index must be >= 0");
    if (i >= capacity()) rows_.resize(static_cast<size_t>(i) + 1);
    return rows_[i];
  }
  Row& existing(int64_t i) {
    if (!has(i)) throw std::out_of_range("row " + std::to_string(i) + " has no constraint");
    return rows_[i];
  }

  void restart(Row& r) {
    r.st = initial_state(*r.prog);
    r.consumed = 0;
    r.last = -1;
  }

  // The state is a function of the history alone: if the history no longer extends what was
  // consumed (shorter, or a different token where the last consumed one was), start over and
  // replay. Stops at the first negative id (async scheduling's not-yet-known placeholder).
  int sync_row(Row& r) {
    if (!r.hist) return 0;
    PyObject* seq = PySequence_Fast(r.hist, "history must be a sequence of token ids");
    if (!seq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    int restarted = 0;
    if (n < r.consumed || (r.consumed > 0 && PyLong_AsLong(items[r.consumed - 1]) != r.last)) {
      restart(r);
      restarted = 1;
      ++replays_;
    }
    for (Py_ssize_t k = r.consumed; k < n; ++k) {
      const long t = PyLong_AsLong(items[k]);
      if (t == -1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        throw py::error_already_set();
      }
      if (t < 0) break;
      step(*r.prog, r.st, t > INT32_MAX ? -1 : static_cast<int32_t>(t));
      r.last = static_cast<int32_t>(t);
      ++r.consumed;
    }
    Py_DECREF(seq);
    return restarted;
  }

  void fill_row(int64_t i, uint32_t* out) const {
    if (i < capacity() && rows_[i].prog) {
      const Row& r = rows_[i];
      fill_mask(*r.prog, r.st, r.eos.data(), static_cast<int>(r.eos.size()), out);
      return;
    }
    std::memset(out, 0xFF, sizeof(uint32_t) * words_);
    if (vocab_ % 32) out[words_ - 1] = (1u << (vocab_ % 32)) - 1;
  }

  int32_t vocab_, words_;
  ThreadPool pool_;
  std::vector<Row> rows_;
  int64_t replays_ = 0;
};

uint32_t* mask_buffer(py::buffer& b, int64_t n_rows, int64_t words, int64_t* stride, bool writable) {
  py::buffer_info info = b.request(writable);
  if (info.ndim != 2 || info.itemsize != 4)
    throw std::invalid_argument("bitmask must be a 2-D int32 array [batch, ceil(vocab/32)]");
  if (info.shape[0] < n_rows)
    throw std::invalid_argument("bitmask has " + std::to_string(info.shape[0]) + " rows, need " + std::to_string(n_rows));
  if (info.shape[1] < words)
    throw std::invalid_argument("bitmask has " + std::to_string(info.shape[1]) + " words per row, need " +
                                std::to_string(words));
  if (info.strides[1] != 4 || info.strides[0] % 4) throw std::invalid_argument("bitmask rows must be contiguous");
  *stride = info.strides[0] / 4;
  return static_cast<uint32_t*>(info.ptr);
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "Native constraint engine (see modelops_native).";
  m.attr("MAX_UNIQUE_ITEMS") = kMaxUniqueItems;
  py::register_exception<std::invalid_argument>(m, "SpecError", PyExc_ValueError);

  py::class_<Leaf, std::shared_ptr<Leaf>>(m, "Leaf")
      .def_property_readonly("kind", [](const Leaf& l) { return l.kind == Leaf::kCatalog ? "catalog" : "dfa"; })
      .def_property_readonly("memory_bytes", &Leaf::bytes)
      .def_property_readonly("num_edges", [](const Leaf& l) {
        return l.kind == Leaf::kCatalog ? l.cat.n_edges() : static_cast<int64_t>(l.dfa.trans_set.size());
      })
      .def_property_readonly("num_nodes", [](const Leaf& l) {
        return l.kind == Leaf::kCatalog ? static_cast<int64_t>(l.cat.n_nodes())
                                        : static_cast<int64_t>(l.dfa.accepting.size());
      })
      .def_property_readonly("num_items", [](const Leaf& l) { return l.kind == Leaf::kCatalog ? l.cat.n_unique_items : 0; });

  m.def(
      "build_catalog",
      [](py::buffer tokens, py::buffer offsets, int32_t vocab, int64_t dense_min_children) {
        int64_t n_tok = 0, n_off = 0;
        const int32_t* t = vector_buffer<int32_t>(tokens, "tokens", &n_tok);
        const int64_t* o = vector_buffer<int64_t>(offsets, "offsets", &n_off);
        if (n_off < 1 || o[0] != 0 || o[n_off - 1] != n_tok)
          throw std::invalid_argument("offsets must start at 0 and end at len(tokens)");
        py::gil_scoped_release nogil;
        return build_catalog(t, o, n_off - 1, vocab, dense_min_children);
      },
      py::arg("tokens"), py::arg("offsets"), py::arg("vocab_size"), py::arg("dense_min_children"));

  m.def(
      "build_dfa",
      [](int32_t n_states, int32_t start, std::vector<int32_t> accepting, std::vector<std::vector<int32_t>> sets,
         py::buffer transitions, int32_t vocab) {
        py::buffer_info info = transitions.request();
        if (info.itemsize != 4 || (info.ndim == 2 && info.shape[1] != 3) || info.ndim > 2 ||
            (info.ndim == 1 && info.shape[0] != 0))
          throw std::invalid_argument("transitions must be an int32 array [n, 3]");
        const int64_t n = info.ndim == 2 ? info.shape[0] : 0;
        if (n && (info.strides[1] != 4 || info.strides[0] != 12))
          throw std::invalid_argument("transitions must be contiguous");
        py::gil_scoped_release nogil;
        return build_dfa(n_states, start, accepting, sets, static_cast<const int32_t*>(info.ptr), n, vocab);
      },
      py::arg("num_states"), py::arg("start"), py::arg("accepting"), py::arg("sets"), py::arg("transitions"),
      py::arg("vocab_size"));

  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init([](py::list segments, int32_t vocab) {
             std::vector<Segment> segs;
             for (py::handle h : segments) {
               auto t = h.cast<py::tuple>();
               if (t.size() != 6) throw std::invalid_argument("segment must be (leaf, min, max, separator, unique, path)");
               Segment g;
               g.leaf = t[0].cast<std::shared_ptr<Leaf>>();
               g.min = t[1].cast<int32_t>();
               g.max = t[2].cast<int32_t>();
               g.sep = t[3].cast<std::vector<int32_t>>();
               g.unique = t[4].cast<bool>();
               g.path = t[5].cast<std::string>();
               segs.push_back(std::move(g));
             }
             return std::make_shared<Program>(std::move(segs), vocab);
           }),
           py::arg("segments"), py::arg("vocab_size"))
      .def_property_readonly("vocab_size", [](const Program& p) { return p.vocab; })
      .def_property_readonly("memory_bytes", [](const Program& p) {
        size_t b = p.bytes();
        std::vector<const Leaf*> seen;
        for (const auto& g : p.segs)
          if (std::find(seen.begin(), seen.end(), g.leaf.get()) == seen.end()) {
            seen.push_back(g.leaf.get());
            b += g.leaf->bytes();
          }
        return b;
      });

  py::class_<Batch>(m, "Batch")
      .def(py::init<int32_t, int>(), py::arg("vocab_size"), py::arg("num_threads"))
      .def_property_readonly("vocab_size", &Batch::vocab)
      .def_property_readonly("words", &Batch::words)
      .def_property_readonly("num_threads", &Batch::threads)
      .def_property_readonly("capacity", &Batch::capacity)
      .def_property_readonly("replays", &Batch::replays)
      .def("add", &Batch::add, py::arg("row"), py::arg("program"), py::arg("eos"), py::arg("history"))
      .def("remove", &Batch::remove, py::arg("row"))
      .def("move", &Batch::move, py::arg("src"), py::arg("dst"))
      .def("swap", &Batch::swap, py::arg("a"), py::arg("b"))
      .def("sync", &Batch::sync)
      .def("advance", &Batch::advance, py::arg("row"), py::arg("tokens"))
      .def("reset", &Batch::reset, py::arg("row"))
      .def("has", &Batch::has, py::arg("row"))
      .def("accepts", &Batch::accepts_row, py::arg("row"))
      .def("dead", &Batch::dead, py::arg("row"))
      .def("consumed", &Batch::consumed, py::arg("row"))
      .def("state_bytes", &Batch::state_bytes, py::arg("row"))
      .def(
          "fill",
          [](Batch& b, py::buffer out, int64_t n_rows) {
            int64_t stride = 0;
            uint32_t* p = mask_buffer(out, n_rows, b.words(), &stride, true);
            py::gil_scoped_release nogil;
            b.fill(p, n_rows, stride);
          },
          py::arg("out"), py::arg("num_rows"))
      .def(
          "apply",
          [](Batch& b, uintptr_t logits, int dtype, int64_t n_rows, int64_t cols, int64_t row_stride, py::buffer mask) {
            if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype code must be 0, 1 or 2");
            int64_t stride = 0;
            const uint32_t* p = mask_buffer(mask, n_rows, (cols + 31) / 32, &stride, false);
            py::gil_scoped_release nogil;
            b.apply(reinterpret_cast<void*>(logits), dtype, n_rows, cols, row_stride, p, stride);
          },
          py::arg("logits_ptr"), py::arg("dtype"), py::arg("num_rows"), py::arg("cols"), py::arg("row_stride"),
          py::arg("bitmask"));
}
