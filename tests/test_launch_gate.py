"""The compiled call gate (kernels/launch_gate.cpp) on CPU tensors, with a stub launcher that counts its calls.
For each of its functions (prefill, append, prepare): a valid call fills the launch block's tensor fields and
calls the launcher once; every broken tensor contract is refused with nothing written into the block and nothing
launched (the API's checked path then names the error: tests/test_cuda_launch_gate.py drives that end to end on
a GPU)."""

import ctypes
import shutil
import subprocess
from dataclasses import dataclass

import pytest
import torch

from pagedwindow.cuda import launch_gate, ops

ROWS, HQ, HKV = 5, 4, 2
STUB = """
int stub_calls;
int stub_status;
const void* stub_block;
void* stub_stream;
int stub_launch(const void* block, void* stream) {
  ++stub_calls;
  stub_block = block;
  stub_stream = stream;
  return stub_status;
}
"""


@dataclass(frozen=True)
class Function:
    """One gate function: its tensor arguments in order, its launch block, the block field each tensor's address
    goes to, the tensors it writes, its head_dim and the sizes it takes after the tensors."""

    name: str
    tensors: tuple[str, ...]
    block: type
    fields: dict
    written: tuple[str, ...]
    head_dim: int

    def sizes(self, rows: int) -> tuple[int, ...]:
        return {
            "prefill": (rows, HQ, self.head_dim),
            "append": (rows, HKV, self.head_dim),
            "prepare": (rows, HQ, HKV, self.head_dim),
        }[self.name]


PREFILL = Function(
    "prefill", ("q", "pool", "out", "lse"), ops.PrefillLaunch, {"q": "q", "pool": "pool", "out": "out", "lse": "lse"},
    ("out", "lse"), 256,
)  # fmt: skip
APPEND = Function("append", ("k", "v", "pool"), ops.AppendLaunch, {"k": "k", "v": "v", "pool": "pool"}, ("pool",), 64)
PREPARE = Function(
    "prepare",
    ("q", "k", "v", "pool", "out_q", "q_norm_weight", "k_norm_weight"),
    ops.PrepareLaunch,
    {"q": "q", "k": "k", "v": "v", "pool": "pool", "out_q": "q_out", "q_norm_weight": "q_weight"}
    | {"k_norm_weight": "k_weight"},
    ("out_q", "pool"),
    64,
)
FUNCTIONS = (PREFILL, APPEND, PREPARE)
ROWS_Q = ("q", "out", "out_q")  # [rows, HQ, D]
ROWS_KV = ("k", "v")  # [rows, HKV, D]
WEIGHTS = ("q_norm_weight", "k_norm_weight")


@pytest.fixture(scope="module")
def gate():
    module = launch_gate.module()
    assert module is not None, f"the call gate did not build: {launch_gate.unavailable_reason()}"
    return module


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler (cc / gcc) on PATH for the stub launcher")
    directory = tmp_path_factory.mktemp("stub")
    (directory / "stub.c").write_text(STUB)
    library = directory / "libstub.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(directory / "stub.c")], check=True)
    return ctypes.CDLL(str(library))


def _calls(stub) -> int:
    return ctypes.c_int.in_dll(stub, "stub_calls").value


def _tensors(f: Function, dtype=None, weight_dtype=None, rows=ROWS) -> dict:
    """Valid tensors for ``f``: the pool's dtype is bf16 unless given (the attention runs bf16 only)."""
    gen = torch.Generator().manual_seed(0)
    dtype = dtype or torch.bfloat16
    d = f.head_dim
    make = {
        "q": lambda: torch.randn(rows, HQ, d, generator=gen).to(dtype),
        "out": lambda: torch.zeros(rows, HQ, d, dtype=dtype),
        "out_q": lambda: torch.zeros(rows, HQ, d, dtype=dtype),
        "k": lambda: torch.randn(rows, HKV, d, generator=gen).to(dtype),
        "v": lambda: torch.randn(rows, HKV, d, generator=gen).to(dtype),
        "lse": lambda: torch.zeros(rows, HQ, dtype=torch.float32),
        "pool": lambda: torch.zeros(3, 2, 2, 16, HKV, d, dtype=dtype),
        "q_norm_weight": lambda: torch.ones(d, dtype=weight_dtype or dtype),
        "k_norm_weight": lambda: torch.ones(d, dtype=weight_dtype or dtype),
    }
    return {name: make[name]() for name in f.tensors}


def _call(gate, stub, f: Function, block, t: dict, *, rows=ROWS, stream=77):
    launcher = ctypes.cast(stub.stub_launch, ctypes.c_void_p).value
    args = [t[name] for name in f.tensors]
    return getattr(gate, f.name)(*args, *f.sizes(rows), ctypes.addressof(block), launcher, stream)


def _block(f: Function):
    """A block with every byte set, so that a refused call's untouched block is seen."""
    block = f.block()
    ctypes.memset(ctypes.addressof(block), 0xA5, ctypes.sizeof(block))
    return block


def _field_address(value) -> int | None:
    """A ctypes pointer field's address (c_void_p reads as an int, typed pointers as objects)."""
    return ctypes.cast(value, ctypes.c_void_p).value if not isinstance(value, int) else value


def test_the_gate_and_the_host_agree_on_the_launch_blocks(gate):
    assert gate.PREFILL_LAUNCH_BYTES == ctypes.sizeof(ops.PrefillLaunch)
    assert gate.APPEND_LAUNCH_BYTES == ctypes.sizeof(ops.AppendLaunch)
    assert gate.PREPARE_LAUNCH_BYTES == ctypes.sizeof(ops.PrepareLaunch)
    assert gate.REFUSED < 0


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.name)
def test_a_valid_call_fills_the_blocks_tensor_fields_and_calls_the_launcher_once(gate, stub, f):
    t = _tensors(f)
    block = _block(f)
    before = _calls(stub)
    assert _call(gate, stub, f, block, t, stream=1234) == 0
    assert _calls(stub) == before + 1
    assert ctypes.c_void_p.in_dll(stub, "stub_block").value == ctypes.addressof(block)
    assert ctypes.c_void_p.in_dll(stub, "stub_stream").value == 1234
    for name, field in f.fields.items():
        assert _field_address(getattr(block, field)) == t[name].data_ptr(), name
    assert block.page_size == ctypes.c_int.from_buffer_copy(b"\xa5" * 4).value  # the caller's fields untouched


def test_prefill_without_lse_writes_a_null_lse(gate, stub):
    t = _tensors(PREFILL) | {"lse": None}
    block = _block(PREFILL)
    assert _call(gate, stub, PREFILL, block, t) == 0
    assert _field_address(block.lse) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_append_writes_the_element_size(gate, stub, dtype):
    block = _block(APPEND)
    assert _call(gate, stub, APPEND, block, _tensors(APPEND, dtype)) == 0
    assert block.elem_bytes == torch.empty(0, dtype=dtype).element_size()


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "code", "weight_fp32"),
    [
        (torch.bfloat16, torch.bfloat16, 0, 0),
        (torch.bfloat16, torch.float32, 0, 1),
        (torch.float16, torch.float16, 1, 0),
        (torch.float32, torch.float32, 2, 1),
    ],
)
def test_prepare_writes_the_dtype_codes(gate, stub, dtype, weight_dtype, code, weight_fp32):
    block = _block(PREPARE)
    assert _call(gate, stub, PREPARE, block, _tensors(PREPARE, dtype, weight_dtype)) == 0
    assert (block.dtype, block.weight_fp32) == (code, weight_fp32)


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.name)
def test_the_launchers_status_comes_back(gate, stub, f):
    ctypes.c_int.in_dll(stub, "stub_status").value = 7
    try:
        assert _call(gate, stub, f, _block(f), _tensors(f)) == 7
    finally:
        ctypes.c_int.in_dll(stub, "stub_status").value = 0


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.name)
def test_what_the_api_accepts_the_gate_launches(gate, stub, f):
    """Inputs that require grad (read as values), nn.Parameter weights, more rows than the plan's, and inference
    tensors written inside inference mode."""
    t = _tensors(f, rows=ROWS + 2)
    for name in f.tensors:
        if name not in f.written and name != "pool":
            t[name] = torch.nn.Parameter(t[name]) if name in WEIGHTS else t[name].requires_grad_()
    assert _call(gate, stub, f, _block(f), t) == 0
    with torch.inference_mode():
        assert _call(gate, stub, f, _block(f), _tensors(f)) == 0


class Sub(torch.Tensor):
    pass


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return shifted.copy_(t)


def _inference_copy(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _alias(t: dict, written: str, other: str) -> dict:
    """The smaller of the two tensors replaced by a view of the larger one's first bytes."""
    small, large = sorted((written, other), key=lambda n: t[n].numel() * t[n].element_size())
    as_bytes = t[large].view(-1).view(torch.uint8)[: t[small].numel() * t[small].element_size()]
    return t | {small: as_bytes.view(t[small].dtype).view(t[small].shape)}


def _bad_cases(f: Function):
    """(id, a function of the valid tensors returning the broken ones)."""
    other_dtype = torch.float16 if f.name != "prefill" else torch.float32
    cases = []
    for name in f.tensors:
        if name != "lse":  # lse=None is a valid call
            cases.append((f"{name}-None", lambda t, n=name: t | {n: None}))
        cases += [
            (f"{name}-list", lambda t, n=name: t | {n: t[n].tolist()}),
            (f"{name}-subclass", lambda t, n=name: t | {n: t[n].as_subclass(Sub)}),
            (f"{name}-meta", lambda t, n=name: t | {n: t[n].to("meta")}),
            (f"{name}-misaligned", lambda t, n=name: t | {n: _misaligned(t[n])}),
            (f"{name}-sparse", lambda t, n=name: t | {n: t[n].to_sparse()}),
        ]
        if name == "lse":
            cases.append(("lse-bf16", lambda t: t | {"lse": t["lse"].bfloat16()}))
        elif name != "pool":  # the pool's dtype is the call's: another dtype elsewhere is the mismatch
            cases.append((f"{name}-{other_dtype}", lambda t, n=name, d=other_dtype: t | {n: t[n].to(d)}))
        if name in ROWS_Q + ROWS_KV:
            cases += [
                (f"{name}-too-few-rows", lambda t, n=name: t | {n: t[n][:-1]}),
                (f"{name}-a-head-short", lambda t, n=name: t | {n: t[n][:, :-1].contiguous()}),
                (f"{name}-head-dim-short", lambda t, n=name: t | {n: t[n][..., :-8].contiguous()}),
                (f"{name}-2d", lambda t, n=name: t | {n: t[n].flatten(1)}),
                (
                    f"{name}-not-contiguous",
                    lambda t, n=name: t | {n: t[n].transpose(0, 1).contiguous().transpose(0, 1)},
                ),
            ]
        if name == "lse":
            cases += [
                ("lse-too-few-rows", lambda t: t | {"lse": t["lse"][:-1]}),
                ("lse-a-head-short", lambda t: t | {"lse": t["lse"][:, :-1].contiguous()}),
                ("lse-3d", lambda t: t | {"lse": t["lse"].unsqueeze(-1)}),
                ("lse-not-contiguous", lambda t: t | {"lse": t["lse"].t().contiguous().t()}),
            ]
        if name in WEIGHTS:
            cases += [
                (f"{name}-short", lambda t, n=name: t | {n: t[n][:-8].contiguous()}),
                (f"{name}-2d", lambda t, n=name: t | {n: t[n].view(2, -1)}),
                (f"{name}-strided", lambda t, n=name: t | {n: torch.ones(2 * f.head_dim, dtype=t[n].dtype)[::2]}),
            ]
    if f is PREPARE:
        cases.append(("weights-of-two-dtypes", lambda t: t | {"k_norm_weight": t["k_norm_weight"].float()}))
    cases.append(("int32-tensors", lambda t: {n: x.to(torch.int32) for n, x in t.items()}))
    if f is PREFILL:
        cases.append(("fp16-tensors", lambda t: t | {n: t[n].half() for n in ("q", "pool", "out")}))
    for name in f.written:
        cases.append((f"{name}-requires-grad", lambda t, n=name: t | {n: t[n].clone().requires_grad_()}))
        cases.append((f"{name}-inference-tensor", lambda t, n=name: t | {n: _inference_copy(t[n])}))
    for written in f.written:  # every written tensor against every other: a view of the same bytes
        for other in f.tensors:
            if other != written and not (other in f.written and other < written):
                cases.append((f"{written}-aliases-{other}", lambda t, w=written, o=other: _alias(t, w, o)))
    return cases


BAD = [(f, case_id, make) for f in FUNCTIONS for case_id, make in _bad_cases(f)]


@pytest.mark.parametrize(("f", "make"), [(f, m) for f, _, m in BAD], ids=[f"{f.name}-{i}" for f, i, _ in BAD])
def test_each_broken_contract_is_refused_with_nothing_written_or_launched(gate, stub, f, make):
    t = make(_tensors(f))
    block = _block(f)
    before, calls = bytes(block), _calls(stub)
    assert _call(gate, stub, f, block, t) == gate.REFUSED
    assert bytes(block) == before and _calls(stub) == calls


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.name)
def test_an_empty_batch_is_refused(gate, stub, f):
    block = _block(f)
    assert _call(gate, stub, f, block, _tensors(f), rows=0) == gate.REFUSED
    assert bytes(block) == bytes(_block(f))


@pytest.mark.parametrize("f", FUNCTIONS, ids=lambda f: f.name)
def test_malformed_integer_arguments_raise(gate, stub, f):
    t = _tensors(f)
    launcher = ctypes.cast(stub.stub_launch, ctypes.c_void_p).value
    args = [t[name] for name in f.tensors]
    sizes = f.sizes(ROWS)
    address = ctypes.addressof(_block(f))
    call = getattr(gate, f.name)
    with pytest.raises(TypeError):
        call(*args, "5", *sizes[1:], address, launcher, 0)
    with pytest.raises(TypeError):
        call(*args, *sizes, address, launcher)
    with pytest.raises(ValueError):
        call(*args, *sizes, 0, launcher, 0)
    with pytest.raises(OverflowError):
        call(*args, *sizes, -1, launcher, 0)


def test_the_gates_build_is_cached_by_the_kernels_protocol(gate, caplog):
    """A second build is the cached, verified module (``build.cached_build``), logged as a launch gate cache hit."""
    import logging

    caplog.set_level(logging.DEBUG, logger="pagedwindow.cuda.build")
    path = launch_gate.build_module()
    assert str(path) == gate.__file__
    assert f"launch gate cache hit: {path}" in [r.getMessage() for r in caplog.records]
