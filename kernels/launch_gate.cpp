// pagedwindow: the compiled call gate, a CPython extension module (built against torch's headers by
// src/pagedwindow/cuda/launch_gate.py with the host's C++ compiler; no CUDA headers, no kernels).
//
// prepare(q, k, v, pool, out_q, q_norm_weight, k_norm_weight, rows, num_qo_heads, num_kv_heads, head_dim,
//         block, launcher, stream) -> int
//
// Every per-call tensor contract of prepare_paged_qkv (src/pagedwindow/api.py) in one C call, then the launch:
// each tensor is a plain torch.Tensor (or nn.Parameter) that is strided and contiguous, on the pool's device, in
// the pool's dtype (the norm weights: the pool's dtype or fp32, both the same); q and out_q are
// [>= rows, num_qo_heads, head_dim], k and v [>= rows, num_kv_heads, head_dim], the weights [head_dim]; out_q
// and the pool may be written (no grad; made under inference mode only inside it); neither shares a byte with
// any other tensor of the call; every address is a multiple of 16 bytes. When all hold, the gate writes the
// seven tensor addresses, the dtype code and the weights' width into the PwPrepareLaunch at `block` (whose plan
// fields and scalars the caller filled), calls `launcher(block, stream)` and returns its status (0, or the
// launcher's error code). When any fails it returns REFUSED having written and launched nothing: the caller
// then runs its checked Python path, which names the error (or, for a case this gate is stricter about than
// that path, e.g. a tensor subclass, launches the checked way). It never raises for a tensor argument; a
// malformed integer argument raises TypeError/OverflowError (a caller bug, not user input).
#include <Python.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

#include "launch_blocks.cuh"

namespace {

constexpr long kRefused = -1000;           // not a launcher status: those are 0, negative and small, or a cudaError_t
constexpr std::uintptr_t kAlignment = 16;  // the kernels' 16-byte vector loads and copies
constexpr Py_ssize_t kPrepareArgs = 14;

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

bool overlap(const Span& a, const Span& b) { return a.begin < b.end && b.begin < a.end; }

int dtype_code(c10::ScalarType dtype) {  // PwPrepareLaunch::dtype
  switch (dtype) {
    case c10::ScalarType::BFloat16: return 0;
    case c10::ScalarType::Half: return 1;
    case c10::ScalarType::Float: return 2;
    default: return -1;
  }
}

bool as_int64(PyObject* o, int64_t* out) {
  *out = PyLong_AsLongLong(o);
  return !(*out == -1 && PyErr_Occurred());
}

bool as_address(PyObject* o, std::uintptr_t* out) {
  *out = static_cast<std::uintptr_t>(PyLong_AsUnsignedLongLong(o));
  return !(*out == static_cast<std::uintptr_t>(-1) && PyErr_Occurred());
}

PyObject* prepare(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != kPrepareArgs) {
    PyErr_Format(PyExc_TypeError, "prepare() takes %zd arguments (%zd given)", kPrepareArgs, nargs);
    return nullptr;
  }
  int64_t rows, num_qo_heads, num_kv_heads, head_dim;
  std::uintptr_t block_address, launcher_address, stream;
  if (!as_int64(args[7], &rows) || !as_int64(args[8], &num_qo_heads) || !as_int64(args[9], &num_kv_heads) ||
      !as_int64(args[10], &head_dim) || !as_address(args[11], &block_address) ||
      !as_address(args[12], &launcher_address) || !as_address(args[13], &stream))
    return nullptr;
  if (block_address == 0 || launcher_address == 0) {
    PyErr_SetString(PyExc_ValueError, "prepare(): block and launcher must be non-null addresses");
    return nullptr;
  }
  try {
    if (!THPVariable_CheckExact(args[3]) || rows < 1) return PyLong_FromLong(kRefused);
    const at::Tensor& pool = THPVariable_Unpack(args[3]);
    const c10::Device device = pool.device();
    const at::Tensor* pool_checked = plain_tensor(args[3], device);
    const at::Tensor* q = plain_tensor(args[0], device);
    const at::Tensor* k = plain_tensor(args[1], device);
    const at::Tensor* v = plain_tensor(args[2], device);
    const at::Tensor* out_q = plain_tensor(args[4], device);
    const at::Tensor* q_weight = plain_tensor(args[5], device);
    const at::Tensor* k_weight = plain_tensor(args[6], device);
    if (!pool_checked || !q || !k || !v || !out_q || !q_weight || !k_weight) return PyLong_FromLong(kRefused);
    const c10::ScalarType dtype = pool.scalar_type();
    const int code = dtype_code(dtype);
    if (code < 0 || !rows_of(*q, rows, num_qo_heads, head_dim, dtype) ||
        !rows_of(*k, rows, num_kv_heads, head_dim, dtype) || !rows_of(*v, rows, num_kv_heads, head_dim, dtype) ||
        !rows_of(*out_q, rows, num_qo_heads, head_dim, dtype))
      return PyLong_FromLong(kRefused);
    const c10::ScalarType weight_dtype = q_weight->scalar_type();
    if (q_weight->dim() != 1 || q_weight->size(0) != head_dim || k_weight->dim() != 1 ||
        k_weight->size(0) != head_dim || k_weight->scalar_type() != weight_dtype ||
        (weight_dtype != dtype && weight_dtype != c10::ScalarType::Float))
      return PyLong_FromLong(kRefused);
    if (!writable(*out_q) || !writable(pool)) return PyLong_FromLong(kRefused);
    // The written tensors first: out_q, then the pool; neither may share a byte with any later span.
    const Span spans[7] = {span_of(*out_q), span_of(pool),      span_of(*q),       span_of(*k),
                           span_of(*v),     span_of(*q_weight), span_of(*k_weight)};
    std::uintptr_t address_bits = 0;
    for (const Span& s : spans) address_bits |= s.begin;
    if (address_bits % kAlignment != 0) return PyLong_FromLong(kRefused);
    for (int w = 0; w < 2; ++w)
      for (int i = w + 1; i < 7; ++i)
        if (overlap(spans[w], spans[i])) return PyLong_FromLong(kRefused);

    auto* block = reinterpret_cast<PwPrepareLaunch*>(block_address);
    block->q = q->data_ptr();
    block->k = k->data_ptr();
    block->v = v->data_ptr();
    block->q_out = out_q->data_ptr();
    block->pool = pool.data_ptr();
    block->q_weight = q_weight->data_ptr();
    block->k_weight = k_weight->data_ptr();
    block->dtype = code;
    block->weight_fp32 = weight_dtype == c10::ScalarType::Float ? 1 : 0;
    const auto launcher = reinterpret_cast<Launcher>(launcher_address);
    return PyLong_FromLong(launcher(block, reinterpret_cast<void*>(stream)));
  } catch (...) {  // a tensor whose metadata cannot be read (c10::Error): the checked path names it
    return PyLong_FromLong(kRefused);
  }
}

PyMethodDef methods[] = {
    {"prepare", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prepare)), METH_FASTCALL,
     "Check a prepare_paged_qkv call's tensors and launch it; REFUSED (nothing written) when a check fails."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedwindow_launch_gate", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_pagedwindow_launch_gate() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "REFUSED", kRefused) < 0 ||
      PyModule_AddIntConstant(m, "PREPARE_LAUNCH_BYTES", static_cast<long>(sizeof(PwPrepareLaunch))) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
