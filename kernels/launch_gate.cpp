// pagedwindow: the compiled call gate, a CPython extension module (built against torch's headers by
// src/pagedwindow/cuda/launch_gate.py with the host's C++ compiler; no CUDA headers, no kernels).
//
// One function per wrapper of src/pagedwindow/api.py, each the wrapper's per-call tensor contracts in one C call,
// then the launch:
//
//   prefill(q, pool, out, lse, rows, num_qo_heads, head_dim, block, launcher, stream) -> int
//   append(k, v, pool, rows, num_kv_heads, head_dim, block, launcher, stream) -> int
//   prepare(q, k, v, pool, out_q, q_norm_weight, k_norm_weight, rows, num_qo_heads, num_kv_heads, head_dim,
//           block, launcher, stream) -> int
//
// The contracts: each tensor is a plain torch.Tensor (or nn.Parameter) that is strided and contiguous, on the
// pool's device, in the pool's dtype (lse: fp32; the norm weights: the pool's dtype or fp32, both the same), which
// is bf16 for the attention and bf16, fp16 or fp32 for the others;
// q, out and out_q are [>= rows, num_qo_heads, head_dim], k and v [>= rows, num_kv_heads, head_dim], lse
// [>= rows, num_qo_heads], the weights [head_dim]; what the call writes (out, lse, out_q, the pool) may be
// written (no grad; made under inference mode only inside it) and shares no byte with any other tensor of the
// call; every address is a multiple of 16 bytes; rows > 0. lse may be None (prefill only).
//
// When all hold, the gate writes the tensors' addresses (and the prep's dtype codes, the append's element size)
// into the launch block at `block`, whose plan fields and scalars the caller filled, calls
// `launcher(block, stream)` and returns its status (0, or the launcher's error code). When any fails it returns
// REFUSED having written and launched nothing: the caller then runs its checked Python path, which names the
// error (or, for a case this gate is stricter about than that path, e.g. a tensor subclass, launches the checked
// way). A tensor argument never makes it raise; a malformed integer argument raises TypeError, ValueError or
// OverflowError (a caller's bug, not user input).
#include <Python.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

#include "launch_blocks.cuh"

namespace {

constexpr long kRefused = -1000;           // not a launcher status: those are 0, negative and small, or a cudaError_t
constexpr std::uintptr_t kAlignment = 16;  // the kernels' 16-byte vector loads and copies

using Launcher = int (*)(const void* block, void* stream);

// The tensor `o` holds when it is a plain, strided, contiguous tensor with storage on `device`; else nullptr.
const at::Tensor* plain_tensor(PyObject* o, const c10::Device& device) {
  if (!THPVariable_CheckExact(o)) return nullptr;  // torch.Tensor or nn.Parameter, no subclass
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage() || t.device() != device) return nullptr;
  if (!t.is_contiguous()) return nullptr;
  return &t;
}

// `t` is [>= rows, heads, head_dim] of `dtype`.
bool rows_of(const at::Tensor& t, int64_t rows, int64_t heads, int64_t head_dim, c10::ScalarType dtype) {
  return t.dim() == 3 && t.size(0) >= rows && t.size(1) == heads && t.size(2) == head_dim && t.scalar_type() == dtype;
}

// The op may write `t`: autograd does not track it, and an inference tensor only inside inference mode.
bool writable(const at::Tensor& t) {
  return !t.requires_grad() && (!t.is_inference() || c10::InferenceMode::is_enabled());
}

struct Span {
  std::uintptr_t begin, end;
};

Span span_of(const at::Tensor& t) {
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  return {begin, begin + t.nbytes()};
}

// The first `written` of `n` spans are written by the call: none shares a byte with any later one, and every
// span starts on a kAlignment-byte boundary.
bool disjoint_and_aligned(const Span* spans, int n, int written) {
  std::uintptr_t address_bits = 0;
  for (int i = 0; i < n; ++i) address_bits |= spans[i].begin;
  if (address_bits % kAlignment != 0) return false;
  for (int w = 0; w < written; ++w)
    for (int i = w + 1; i < n; ++i)
      if (spans[w].begin < spans[i].end && spans[i].begin < spans[w].end) return false;
  return true;
}

int prepare_dtype_code(c10::ScalarType dtype) {  // PwPrepareLaunch::dtype; -1: not bf16, fp16 or fp32
  switch (dtype) {
    case c10::ScalarType::BFloat16: return 0;
    case c10::ScalarType::Half: return 1;
    case c10::ScalarType::Float: return 2;
    default: return -1;
  }
}

// The integer arguments every gate function ends with: the shapes' sizes, then the block, the launcher and the
// stream (addresses). False with a Python exception set when one is malformed.
struct Ints {
  int64_t sizes[4];
  std::uintptr_t block, launcher, stream;
};

bool parse_ints(PyObject* const* args, int num_sizes, Ints* out) {
  for (int i = 0; i < num_sizes; ++i) {
    out->sizes[i] = PyLong_AsLongLong(args[i]);
    if (out->sizes[i] == -1 && PyErr_Occurred()) return false;
  }
  std::uintptr_t* addresses[3] = {&out->block, &out->launcher, &out->stream};
  for (int i = 0; i < 3; ++i) {
    *addresses[i] = static_cast<std::uintptr_t>(PyLong_AsUnsignedLongLong(args[num_sizes + i]));
    if (*addresses[i] == static_cast<std::uintptr_t>(-1) && PyErr_Occurred()) return false;
  }
  if (out->block == 0 || out->launcher == 0) {
    PyErr_SetString(PyExc_ValueError, "the block and the launcher must be non-null addresses");
    return false;
  }
  return true;
}

bool arity(const char* name, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
  return false;
}

PyObject* refused() { return PyLong_FromLong(kRefused); }

PyObject* launch(const Ints& ints) {
  const auto launcher = reinterpret_cast<Launcher>(ints.launcher);
  return PyLong_FromLong(launcher(reinterpret_cast<const void*>(ints.block), reinterpret_cast<void*>(ints.stream)));
}

// The pool, when it is a plain tensor the call may write; nullptr otherwise.
const at::Tensor* writable_pool(PyObject* o) {
  if (!THPVariable_CheckExact(o)) return nullptr;
  const at::Tensor* pool = plain_tensor(o, THPVariable_Unpack(o).device());
  return pool != nullptr && writable(*pool) ? pool : nullptr;
}

PyObject* prefill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Ints ints;
  if (!arity("prefill", nargs, 10) || !parse_ints(args + 4, 3, &ints)) return nullptr;
  const int64_t rows = ints.sizes[0], num_qo_heads = ints.sizes[1], head_dim = ints.sizes[2];
  try {
    if (rows < 1 || !THPVariable_CheckExact(args[1])) return refused();
    const at::Tensor& pool = THPVariable_Unpack(args[1]);
    const c10::Device device = pool.device();
    const c10::ScalarType dtype = pool.scalar_type();
    if (dtype != c10::ScalarType::BFloat16) return refused();  // the attention kernels' one dtype
    const at::Tensor* q = plain_tensor(args[0], device);
    const at::Tensor* out = plain_tensor(args[2], device);
    const bool has_lse = args[3] != Py_None;
    const at::Tensor* lse = has_lse ? plain_tensor(args[3], device) : nullptr;
    if (plain_tensor(args[1], device) == nullptr || q == nullptr || out == nullptr || (has_lse && lse == nullptr))
      return refused();
    if (!rows_of(*q, rows, num_qo_heads, head_dim, dtype) || !rows_of(*out, rows, num_qo_heads, head_dim, dtype) ||
        !writable(*out))
      return refused();
    if (has_lse && !(lse->dim() == 2 && lse->size(0) >= rows && lse->size(1) == num_qo_heads &&
                     lse->scalar_type() == c10::ScalarType::Float && writable(*lse)))
      return refused();
    // The written tensors first: out, then lse when given.
    Span spans[4];
    int n = 0;
    spans[n++] = span_of(*out);
    if (has_lse) spans[n++] = span_of(*lse);
    const int written = n;
    spans[n++] = span_of(*q);
    spans[n++] = span_of(pool);
    if (!disjoint_and_aligned(spans, n, written)) return refused();

    auto* block = reinterpret_cast<PwPrefillLaunch*>(ints.block);
    block->q = q->data_ptr();
    block->out = out->data_ptr();
    block->lse = has_lse ? lse->data_ptr<float>() : nullptr;
    block->pool = pool.data_ptr();
    return launch(ints);
  } catch (...) {  // a tensor whose metadata cannot be read (c10::Error): the checked path names it
    return refused();
  }
}

PyObject* append(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Ints ints;
  if (!arity("append", nargs, 9) || !parse_ints(args + 3, 3, &ints)) return nullptr;
  const int64_t rows = ints.sizes[0], num_kv_heads = ints.sizes[1], head_dim = ints.sizes[2];
  try {
    const at::Tensor* pool = rows >= 1 ? writable_pool(args[2]) : nullptr;
    if (pool == nullptr) return refused();
    const c10::Device device = pool->device();
    const c10::ScalarType dtype = pool->scalar_type();
    if (prepare_dtype_code(dtype) < 0) return refused();  // the pool write's dtypes are the prep's
    const at::Tensor* k = plain_tensor(args[0], device);
    const at::Tensor* v = plain_tensor(args[1], device);
    if (k == nullptr || v == nullptr || !rows_of(*k, rows, num_kv_heads, head_dim, dtype) ||
        !rows_of(*v, rows, num_kv_heads, head_dim, dtype))
      return refused();
    const Span spans[3] = {span_of(*pool), span_of(*k), span_of(*v)};  // the written pool first
    if (!disjoint_and_aligned(spans, 3, 1)) return refused();

    auto* block = reinterpret_cast<PwAppendLaunch*>(ints.block);
    block->k = k->data_ptr();
    block->v = v->data_ptr();
    block->pool = pool->data_ptr();
    block->elem_bytes = static_cast<int>(pool->element_size());
    return launch(ints);
  } catch (...) {
    return refused();
  }
}

PyObject* prepare(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  Ints ints;
  if (!arity("prepare", nargs, 14) || !parse_ints(args + 7, 4, &ints)) return nullptr;
  const int64_t rows = ints.sizes[0], num_qo_heads = ints.sizes[1], num_kv_heads = ints.sizes[2],
                head_dim = ints.sizes[3];
  try {
    const at::Tensor* pool = rows >= 1 ? writable_pool(args[3]) : nullptr;
    if (pool == nullptr) return refused();
    const c10::Device device = pool->device();
    const c10::ScalarType dtype = pool->scalar_type();
    const at::Tensor* q = plain_tensor(args[0], device);
    const at::Tensor* k = plain_tensor(args[1], device);
    const at::Tensor* v = plain_tensor(args[2], device);
    const at::Tensor* out_q = plain_tensor(args[4], device);
    const at::Tensor* q_weight = plain_tensor(args[5], device);
    const at::Tensor* k_weight = plain_tensor(args[6], device);
    if (!q || !k || !v || !out_q || !q_weight || !k_weight) return refused();
    const int code = prepare_dtype_code(dtype);
    if (code < 0 || !rows_of(*q, rows, num_qo_heads, head_dim, dtype) ||
        !rows_of(*k, rows, num_kv_heads, head_dim, dtype) || !rows_of(*v, rows, num_kv_heads, head_dim, dtype) ||
        !rows_of(*out_q, rows, num_qo_heads, head_dim, dtype) || !writable(*out_q))
      return refused();
    const c10::ScalarType weight_dtype = q_weight->scalar_type();
    if (q_weight->dim() != 1 || q_weight->size(0) != head_dim || k_weight->dim() != 1 ||
        k_weight->size(0) != head_dim || k_weight->scalar_type() != weight_dtype ||
        (weight_dtype != dtype && weight_dtype != c10::ScalarType::Float))
      return refused();
    // The written tensors first: out_q, then the pool.
    const Span spans[7] = {span_of(*out_q), span_of(*pool),     span_of(*q),       span_of(*k),
                           span_of(*v),     span_of(*q_weight), span_of(*k_weight)};
    if (!disjoint_and_aligned(spans, 7, 2)) return refused();

    auto* block = reinterpret_cast<PwPrepareLaunch*>(ints.block);
    block->q = q->data_ptr();
    block->k = k->data_ptr();
    block->v = v->data_ptr();
    block->q_out = out_q->data_ptr();
    block->pool = pool->data_ptr();
    block->q_weight = q_weight->data_ptr();
    block->k_weight = k_weight->data_ptr();
    block->dtype = code;
    block->weight_fp32 = weight_dtype == c10::ScalarType::Float ? 1 : 0;
    return launch(ints);
  } catch (...) {
    return refused();
  }
}

PyCFunction fastcall(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f));
}

PyMethodDef methods[] = {
    {"prefill", fastcall(prefill), METH_FASTCALL,
     "Check a batch_prefill_paged_window call's tensors and launch it; REFUSED (nothing written) when one fails."},
    {"append", fastcall(append), METH_FASTCALL,
     "Check an append_paged_kv call's tensors and launch it; REFUSED (nothing written) when one fails."},
    {"prepare", fastcall(prepare), METH_FASTCALL,
     "Check a prepare_paged_qkv call's tensors and launch it; REFUSED (nothing written) when one fails."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedwindow_launch_gate", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pagedwindow_launch_gate() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "REFUSED", kRefused) < 0 ||
      PyModule_AddIntConstant(m, "PREFILL_LAUNCH_BYTES", static_cast<long>(sizeof(PwPrefillLaunch))) < 0 ||
      PyModule_AddIntConstant(m, "APPEND_LAUNCH_BYTES", static_cast<long>(sizeof(PwAppendLaunch))) < 0 ||
      PyModule_AddIntConstant(m, "PREPARE_LAUNCH_BYTES", static_cast<long>(sizeof(PwPrepareLaunch))) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
