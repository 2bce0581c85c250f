"""The compiled call gate (kernels/launch_gate.cpp) on CPU tensors, with a stub launcher that counts its calls:
a valid call fills the launch block and calls the launcher once; every broken tensor contract is refused with
nothing written into the block and nothing launched (the API's checked path then names the error: the GPU tests in
test_cuda_prepare.py drive that end to end)."""

import ctypes
import shutil
import subprocess

import pytest
import torch

from pagedwindow.cuda import launch_gate, ops

ROWS, HQ, HKV, D = 5, 4, 2, 64
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


@pytest.fixture(scope="module")
def gate():
    module = launch_gate.module()
    assert module is not None, "the call gate did not build (see the log's warning)"
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


def _tensors(dtype=torch.bfloat16, weight_dtype=None, rows=ROWS) -> dict:
    gen = torch.Generator().manual_seed(0)
    weight_dtype = weight_dtype or dtype
    return {
        "q": torch.randn(rows, HQ, D, generator=gen).to(dtype),
        "k": torch.randn(rows, HKV, D, generator=gen).to(dtype),
        "v": torch.randn(rows, HKV, D, generator=gen).to(dtype),
        "pool": torch.zeros(3, 2, 2, 16, HKV, D, dtype=dtype),
        "out_q": torch.zeros(rows, HQ, D, dtype=dtype),
        "q_norm_weight": torch.ones(D, dtype=weight_dtype),
        "k_norm_weight": torch.ones(D, dtype=weight_dtype),
    }


NAMES = ("q", "k", "v", "pool", "out_q", "q_norm_weight", "k_norm_weight")
"""The gate's tensor arguments, in its order."""


def _prepare(gate, stub, block, t: dict, *, rows=ROWS, stream=77):
    launcher = ctypes.cast(stub.stub_launch, ctypes.c_void_p).value
    args = [t["q"], t["k"], t["v"], t["pool"], t["out_q"], t["q_norm_weight"], t["k_norm_weight"]]
    return gate.prepare(*args, rows, HQ, HKV, D, ctypes.addressof(block), launcher, stream)


def _block() -> ops.PrepareLaunch:
    """A block with every byte set, so that a refused call's untouched block is seen."""
    block = ops.PrepareLaunch()
    ctypes.memset(ctypes.addressof(block), 0xA5, ctypes.sizeof(block))
    return block


def test_the_gate_and_the_host_agree_on_the_launch_block(gate):
    assert gate.PREPARE_LAUNCH_BYTES == ctypes.sizeof(ops.PrepareLaunch)
    assert gate.REFUSED < 0


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "code", "weight_fp32"),
    [
        (torch.bfloat16, torch.bfloat16, 0, 0),
        (torch.bfloat16, torch.float32, 0, 1),
        (torch.float16, torch.float16, 1, 0),
        (torch.float32, torch.float32, 2, 1),
    ],
)
def test_a_valid_call_fills_the_block_and_calls_the_launcher_once(gate, stub, dtype, weight_dtype, code, weight_fp32):
    t = _tensors(dtype, weight_dtype)
    block = _block()
    before = _calls(stub)
    assert _prepare(gate, stub, block, t, stream=1234) == 0
    assert _calls(stub) == before + 1
    assert ctypes.c_void_p.in_dll(stub, "stub_block").value == ctypes.addressof(block)
    assert ctypes.c_void_p.in_dll(stub, "stub_stream").value == 1234
    fields = {"q": "q", "k": "k", "v": "v", "pool": "pool", "out_q": "q_out", "q_norm_weight": "q_weight"}
    fields["k_norm_weight"] = "k_weight"
    for name, field in fields.items():
        assert getattr(block, field) == t[name].data_ptr(), name
    assert (block.dtype, block.weight_fp32) == (code, weight_fp32)
    assert block.head_dim == ctypes.c_int.from_buffer_copy(b"\xa5" * 4).value  # the caller's fields untouched


def test_the_launchers_status_comes_back(gate, stub):
    ctypes.c_int.in_dll(stub, "stub_status").value = 7
    try:
        assert _prepare(gate, stub, _block(), _tensors()) == 7
    finally:
        ctypes.c_int.in_dll(stub, "stub_status").value = 0


def test_what_the_api_accepts_the_gate_launches(gate, stub):
    """Inputs that require grad (read as values), nn.Parameter weights, more rows than the plan's, a larger
    out_q, and inference tensors written inside inference mode."""
    t = _tensors(rows=ROWS + 2)
    t["q"].requires_grad_()
    t["q_norm_weight"] = torch.nn.Parameter(t["q_norm_weight"])
    t["k_norm_weight"] = torch.nn.Parameter(t["k_norm_weight"])
    assert _prepare(gate, stub, _block(), t) == 0
    with torch.inference_mode():
        t = _tensors()
        assert _prepare(gate, stub, _block(), t) == 0


class Sub(torch.Tensor):
    pass


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    return shifted.copy_(t)


def _bad_cases():
    """(id, a function of the valid tensors returning the broken ones, rows)."""
    cases = []
    for name in NAMES:
        cases += [
            (f"{name}-None", lambda t, n=name: t | {n: None}),
            (f"{name}-list", lambda t, n=name: t | {n: t[n].tolist()}),
            (f"{name}-subclass", lambda t, n=name: t | {n: t[n].as_subclass(Sub)}),
            (f"{name}-meta", lambda t, n=name: t | {n: t[n].to("meta")}),
            (f"{name}-misaligned", lambda t, n=name: t | {n: _misaligned(t[n])}),
            (f"{name}-sparse", lambda t, n=name: t | {n: t[n].to_sparse()}),
        ]
        if name != "pool":  # the pool's dtype is the call's: another dtype elsewhere is the mismatch
            cases.append((f"{name}-fp16", lambda t, n=name: t | {n: t[n].half()}))
    for name in ("q", "k", "v", "out_q"):
        cases += [
            (f"{name}-too-few-rows", lambda t, n=name: t | {n: t[n][:-1]}),
            (f"{name}-a-head-short", lambda t, n=name: t | {n: t[n][:, :-1].contiguous()}),
            (f"{name}-head-dim-short", lambda t, n=name: t | {n: t[n][..., :-2].contiguous()}),
            (f"{name}-2d", lambda t, n=name: t | {n: t[n].flatten(1)}),
            (f"{name}-not-contiguous", lambda t, n=name: t | {n: t[n].transpose(0, 1).contiguous().transpose(0, 1)}),
        ]
    for name in ("q_norm_weight", "k_norm_weight"):
        cases += [
            (f"{name}-short", lambda t, n=name: t | {n: t[n][:-2].contiguous()}),
            (f"{name}-2d", lambda t, n=name: t | {n: t[n].view(2, -1)}),
            (f"{name}-strided", lambda t, n=name: t | {n: torch.ones(2 * D, dtype=t[n].dtype)[::2]}),
        ]
    cases.append(("weights-of-two-dtypes", lambda t: t | {"k_norm_weight": t["k_norm_weight"].float()}))
    cases.append(("int32-tensors", lambda t: {n: x.to(torch.int32) for n, x in t.items()}))
    for name in ("out_q", "pool"):
        cases.append((f"{name}-requires-grad", lambda t, n=name: t | {n: t[n].clone().requires_grad_()}))
        cases.append((f"{name}-inference-tensor", lambda t, n=name: t | {n: _inference_copy(t[n])}))
    for written in ("out_q", "pool"):  # every written tensor against every other: a view of the written bytes
        for other in NAMES:
            if other != written:
                cases.append((f"{written}-aliases-{other}", lambda t, w=written, o=other: _alias(t, w, o)))
    return cases


def _inference_copy(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _alias(t: dict, written: str, other: str) -> dict:
    """The smaller of the two tensors replaced by a view of the larger one's first bytes."""
    small, large = sorted((written, other), key=lambda n: t[n].numel())
    return t | {small: t[large].view(-1)[: t[small].numel()].view(t[small].shape)}


BAD = _bad_cases()


@pytest.mark.parametrize("make", [m for _, m in BAD], ids=[i for i, _ in BAD])
def test_each_broken_contract_is_refused_with_nothing_written_or_launched(gate, stub, make):
    t = make(_tensors())
    block = _block()
    before, calls = bytes(block), _calls(stub)
    assert _prepare(gate, stub, block, t) == gate.REFUSED
    assert bytes(block) == before and _calls(stub) == calls


def test_an_empty_batch_is_refused(gate, stub):
    block = _block()
    assert _prepare(gate, stub, block, _tensors(), rows=0) == gate.REFUSED
    assert bytes(block) == bytes(_block())


def test_malformed_integer_arguments_raise(gate, stub):
    t = _tensors()
    launcher = ctypes.cast(stub.stub_launch, ctypes.c_void_p).value
    args = [t[n] for n in NAMES]
    block = _block()
    with pytest.raises(TypeError):
        gate.prepare(*args, "5", HQ, HKV, D, ctypes.addressof(block), launcher, 0)
    with pytest.raises(TypeError):
        gate.prepare(*args, ROWS, HQ, HKV, D, ctypes.addressof(block), launcher)
    with pytest.raises(ValueError):
        gate.prepare(*args, ROWS, HQ, HKV, D, 0, launcher, 0)
    with pytest.raises(OverflowError):
        gate.prepare(*args, ROWS, HQ, HKV, D, -1, launcher, 0)
