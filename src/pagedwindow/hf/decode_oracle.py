"""Greedy decode oracle: prefill + N decode steps through the paged path vs HF ``generate(do_sample=False)``.

Per case and per prompt:
1. HF reference: ``generate`` under eager, each prompt alone (B = 1, no padding): tokens ``t_0..t_{N-1}`` and the
   per-step logits ``L_0..L_{N-1}`` (``L_0`` from the prompt, ``L_s`` after feeding ``t_{s-1}``).
2. HF floor: the same steps teacher-forced under sdpa (each prompt alone, HF's DynamicCache).
3. Ours, teacher-forced: the model under :func:`~pagedwindow.hf.integration.use_pagedwindow`, all prompts of the
   case as one batch (ragged: pads are dropped by our path), the prompt fed in the case's chunks, then HF's tokens
   one per step; HF keeps no cache (``use_cache=False``, explicit positions): the paged pool is the only KV.
4. Ours, free-running: greedy on our own logits — through ``model.generate`` on the left-padded batch (HF's
   DynamicCache on; we take only the new rows), or, for chunked prefill, through the same stepper.

``fused_prep=True`` runs steps 3 and 4 under ``use_pagedwindow(model, fused_prep=True)``: the sliding layers'
norms and RoPE are ``prepare_paged_qkv``'s, and with no HF cache allowed the free-running tokens come from the
stepper (``use_cache=False``) in every case.

Gates (:mod:`~pagedwindow.hf.tolerance`): logits — ours vs HF eager over all steps of a prompt, fp32 max_rel
<= 1e-4, bf16 max_abs <= max(2 * floor, eps * max|ref|). Tokens — teacher-forced argmax == HF's token at every step
whose HF margin is clear (> 2 * the logits tolerance); free-running tokens == HF's up to the first unclear step
(after one, the contexts may legitimately part).

Conclusive: teacher-forcing compares every step of every request (a divergence at an unclear step does not end
the comparison), but only the clear-margin steps test the tokens. A case whose requests have fewer than
``case.min_clear_steps`` clear steps in all tested nothing about the tokens: its verdict is ``"inconclusive"``
and it does not pass, whatever else held. A failed check makes the verdict ``"failed"`` even then.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import PagedWindowError
from ..kv_state import chunk_steps, prompt_chunks
from ._compat import attention_implementation, cache_kwarg, model_dtype_device, new_dynamic_cache
from .integration import pagedwindow_attention
from .models import random_prompts
from .tolerance import ErrorStats, GateResult, error_stats, gate, margin_is_clear, top2_margin

MIN_CLEAR_STEPS = 8  # clear-margin teacher-forced steps a case needs to be conclusive (all requests together)
VERDICTS = ("passed", "failed", "inconclusive")


@dataclass(frozen=True)
class DecodeCase:
    """prompt_lens: one prompt per request. prefill_chunks: per request, chunk sizes of its prompt (None: one
    chunk). Our path always runs the prompts as one batch; HF runs each alone. min_clear_steps: the clear-margin
    steps (over all requests) the case needs to be conclusive; at least 1 and at most the steps compared
    (``len(prompt_lens) * max_new_tokens``)."""

    name: str
    prompt_lens: tuple
    max_new_tokens: int
    prefill_chunks: tuple | None = None
    page_size: int = 16
    description: str = ""
    min_clear_steps: int = MIN_CLEAR_STEPS

    def __post_init__(self):
        compared = len(self.prompt_lens) * self.max_new_tokens
        if not 1 <= self.min_clear_steps <= compared:
            raise PagedWindowError(
                f"DecodeCase {self.name!r}: min_clear_steps = {self.min_clear_steps} must be in [1, {compared}] "
                f"(the steps compared: {len(self.prompt_lens)} prompt(s) x {self.max_new_tokens} steps)"
            )


def default_decode_cases(sliding_window: int = 16) -> list[DecodeCase]:
    w = sliding_window
    return [
        DecodeCase("window_crossing", (w - 6,), w + 4, description="decode crosses the window edge"),
        DecodeCase(
            "chunked_prefill",
            (2 * w + 5,),
            w + 4,
            ((w + 4, w + 1),),
            page_size=5,
            description="prompt fed in two chunks (second at start_pos > 0), then decode",
        ),
        DecodeCase(
            "batch_ragged",
            (5, 2 * w - 3, w),
            w // 2 + 2,
            page_size=3,
            description="a batch of prompts of different lengths",
        ),
    ]


@torch.no_grad()
def step_logits(
    model,
    prompts: list,
    *,
    continuations: list | None = None,
    max_new_tokens: int | None = None,
    prefill_chunks=None,
    use_cache: bool = False,
    pad_token_id: int = 0,
) -> tuple:
    """Step a batch through ``model`` with explicit 2D masks and positions: the prompts (in ``prefill_chunks``,
    left-padded per step), then one token per step.

    Teacher-forced when ``continuations`` is given (request i is fed ``continuations[i][:-1]``); else greedy on its
    own logits for ``max_new_tokens``. Returns ``(tokens, logits)``: per request the N tokens (the continuation, or
    the greedy picks) and the ``[N, V]`` logits that predicted them. ``use_cache``: give HF a DynamicCache (needed
    for HF's own implementations; our path keeps its KV in the paged pool and needs none).
    """
    dtype, device = model_dtype_device(model)
    bsz = len(prompts)
    chunks = prompt_chunks([len(p) for p in prompts], prefill_chunks)
    if continuations is not None:
        if len(continuations) != bsz or len({len(c) for c in continuations}) != 1:
            raise PagedWindowError("continuations: one list per prompt, all of one length")
        steps = len(continuations[0])
    else:
        if max_new_tokens is None:
            raise PagedWindowError("step_logits: give continuations or max_new_tokens")
        steps = int(max_new_tokens)
    if steps < 1:
        raise PagedWindowError(f"step_logits: {steps} steps")
    cache = new_dynamic_cache(model) if use_cache else None
    ckw = cache_kwarg(model)
    fed = [0] * bsz
    mask_cols = []
    logits: list[list[torch.Tensor]] = [[] for _ in range(bsz)]  # request -> [V] per step
    tokens: list[list[int]] = [[] for _ in range(bsz)]

    def forward(ids, valid, pos):
        mask_cols.append(valid)
        kwargs = {
            "input_ids": ids,
            "attention_mask": torch.cat(mask_cols, dim=1).long(),
            "position_ids": pos,
            "use_cache": use_cache,
        }
        if cache is not None:
            kwargs[ckw] = cache
        return model(**kwargs).logits

    for n in chunk_steps(chunks):
        width = max(n)
        ids = torch.full((bsz, width), pad_token_id, dtype=torch.long, device=device)
        valid = torch.zeros((bsz, width), dtype=torch.bool, device=device)
        pos = torch.zeros((bsz, width), dtype=torch.long, device=device)
        for i in range(bsz):
            if n[i]:
                ids[i, width - n[i] :] = torch.tensor(prompts[i][fed[i] : fed[i] + n[i]], device=device)
                valid[i, width - n[i] :] = True
                pos[i, width - n[i] :] = torch.arange(fed[i], fed[i] + n[i], device=device)
        out = forward(ids, valid, pos)
        for i in range(bsz):
            fed[i] += n[i]
            if n[i] and fed[i] == len(prompts[i]):
                logits[i].append(out[i, -1].float().cpu())
    for t in range(steps):
        for i in range(bsz):
            pick = continuations[i][t] if continuations is not None else int(torch.argmax(logits[i][t]))
            tokens[i].append(int(pick))
        if t == steps - 1:
            break
        ids = torch.tensor([[tokens[i][t]] for i in range(bsz)], dtype=torch.long, device=device)
        pos = torch.tensor([[fed[i]] for i in range(bsz)], dtype=torch.long, device=device)
        out = forward(ids, torch.ones((bsz, 1), dtype=torch.bool, device=device), pos)
        for i in range(bsz):
            fed[i] += 1
            logits[i].append(out[i, -1].float().cpu())
    return tokens, [torch.stack(x) for x in logits]


@torch.no_grad()
def hf_generate(model, prompt: list, max_new_tokens: int, *, impl: str = "eager") -> tuple:
    """HF ``generate(do_sample=False)`` of one prompt under ``impl``; returns (tokens, logits ``[N, V]``).
    EOS does not stop it (``eos_token_id=None``): exactly ``max_new_tokens`` steps."""
    _, device = model_dtype_device(model)
    with attention_implementation(model, impl):
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    if len(tokens) != max_new_tokens or len(out.logits) != max_new_tokens:
        raise PagedWindowError(f"generate returned {len(tokens)} tokens for max_new_tokens={max_new_tokens}")
    return tokens, torch.stack([x[0].float().cpu() for x in out.logits])


@torch.no_grad()
def _generate_batch(model, prompts: list, max_new_tokens: int, pad_token_id: int = 0) -> list:
    """``model.generate`` greedy on the left-padded batch (whatever attention the model uses now)."""
    _, device = model_dtype_device(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )
    return [out[i, width:].tolist() for i in range(len(prompts))]


@dataclass
class RequestDecode:
    """One prompt of a decode case; per-step lists are index-aligned (step s predicts token s)."""

    prompt: list
    hf_tokens: list
    ours_tokens: list  # free-running
    ours_tf_argmax: list  # argmax of our teacher-forced logits
    logit_err: list  # per step: max |ours - hf|
    floor_err: list  # per step: max |sdpa - hf|
    margin: list  # per step: HF's top1 - top2
    clear: list  # per step: margin > 2 * tol
    tol: float  # the logits tolerance (absolute) of the gate
    logits: ErrorStats  # ours vs HF over all steps
    floor: ErrorStats  # sdpa vs HF over all steps
    logits_gate: GateResult
    tf_tokens_ok: bool  # teacher-forced argmax == HF token at every clear step
    free_tokens_ok: bool  # free-running tokens == HF's up to the first unclear step
    first_unclear: int  # first step with an unclear margin (N if none)

    def rows(self, request: int) -> list:
        return [
            {
                "request": request,
                "step": s,
                "hf_token": self.hf_tokens[s],
                "ours_token": self.ours_tokens[s],
                "ours_tf_argmax": self.ours_tf_argmax[s],
                "logit_err": self.logit_err[s],
                "floor_err": self.floor_err[s],
                "margin": self.margin[s],
                "clear": self.clear[s],
                "tol": self.tol,
            }
            for s in range(len(self.hf_tokens))
        ]


@dataclass
class DecodeResult:
    case: DecodeCase
    dtype: str
    backend: str
    requests: list = field(default_factory=list)
    session: dict = field(default_factory=dict)
    fused_prep: bool = False

    @property
    def compared_steps(self) -> int:
        """Teacher-forced steps compared (every step of every request)."""
        return sum(len(r.clear) for r in self.requests)

    @property
    def clear_steps(self) -> int:
        """Compared steps whose HF margin is clear: the ones that test the tokens."""
        return sum(sum(r.clear) for r in self.requests)

    @property
    def failures(self) -> list[str]:
        """What failed, one line each (empty when every check held)."""
        out = []
        for i, r in enumerate(self.requests):
            if not r.logits_gate.passed:
                out.append(
                    f"request {i}: logits {r.logits_gate.rule} fails: "
                    f"{r.logits_gate.value:.3g} > {r.logits_gate.limit:.3g}"
                )
            bad = [s for s, (a, t, c) in enumerate(zip(r.ours_tf_argmax, r.hf_tokens, r.clear)) if c and a != t]
            if bad:
                out.append(f"request {i}: teacher-forced token differs from HF's at clear-margin steps {bad}")
            if not r.free_tokens_ok:
                out.append(
                    f"request {i}: free-running tokens part from HF's before the first unclear step ({r.first_unclear})"
                )
        if not self.requests:
            out.append("no request was compared")
        return out

    @property
    def conclusive(self) -> bool:
        return self.clear_steps >= self.case.min_clear_steps

    @property
    def inconclusive_reason(self) -> str | None:
        """Why the tokens were not tested enough (None when conclusive)."""
        if self.conclusive:
            return None
        return (
            f"inconclusive: only {self.clear_steps} of {self.compared_steps} teacher-forced steps have a clear "
            f"HF margin (top1 - top2 > 2 * tol), fewer than min_clear_steps = {self.case.min_clear_steps}: "
            "the token check tested too little"
        )

    @property
    def verdict(self) -> str:
        """``"failed"`` if any check failed, else ``"inconclusive"`` below ``case.min_clear_steps`` clear steps,
        else ``"passed"``."""
        if self.failures:
            return "failed"
        return "passed" if self.conclusive else "inconclusive"

    @property
    def passed(self) -> bool:
        """Every check held and the run was conclusive."""
        return self.verdict == "passed"

    def rows(self) -> list:
        out = []
        for i, r in enumerate(self.requests):
            for row in r.rows(i):
                out.append(dict(row, case=self.case.name, dtype=self.dtype, backend=self.backend))
        return out

    def summary(self) -> list:
        return [
            {
                "case": self.case.name,
                "request": i,
                "prompt_len": len(r.prompt),
                "dtype": self.dtype,
                "backend": self.backend,
                "ours_max_abs": r.logits.max_abs,
                "ours_max_rel": r.logits.max_rel,
                "floor_max_abs": r.floor.max_abs,
                "floor_max_rel": r.floor.max_rel,
                **{f"gate_{k}": v for k, v in asdict(r.logits_gate).items()},
                "clear_steps": sum(r.clear),
                "steps": len(r.clear),
                "tf_tokens_ok": r.tf_tokens_ok,
                "free_tokens_ok": r.free_tokens_ok,
                "first_unclear": r.first_unclear,
            }
            for i, r in enumerate(self.requests)
        ]


@torch.no_grad()
def run_decode_case(
    model,
    case: DecodeCase,
    *,
    backend: str = "auto",
    seed: int = 0,
    prompts: list | None = None,
    fused_prep: bool = False,
) -> DecodeResult:
    """Run one :class:`DecodeCase` (see the module docstring). The model's attention is restored afterwards.
    ``fused_prep``: our path runs under ``use_pagedwindow(model, fused_prep=True)`` (the sliding layers' norms
    and RoPE by ``prepare_paged_qkv``); HF's cache cannot be used then, so the free-running tokens come from the
    stepper too (``use_cache=False``, explicit positions) instead of ``generate``."""
    dtype, _ = model_dtype_device(model)
    if prompts is None:
        prompts = random_prompts(case.prompt_lens, vocab_size=model.config.vocab_size, seed=seed)
    n = case.max_new_tokens
    hf = [hf_generate(model, p, n, impl="eager") for p in prompts]
    with attention_implementation(model, "sdpa"):
        floor = [
            step_logits(model, [p], continuations=[toks], use_cache=True)[1][0] for p, (toks, _) in zip(prompts, hf)
        ]
    hf_previous = model.config._attn_implementation
    with pagedwindow_attention(
        model, backend=backend, page_size=case.page_size, seed=seed, fused_prep=fused_prep
    ) as session:
        _, ours_tf = step_logits(
            model, prompts, continuations=[t for t, _ in hf], prefill_chunks=case.prefill_chunks, use_cache=False
        )
        if case.prefill_chunks is None and not fused_prep:
            ours_free = _generate_batch(model, prompts, n)
        else:
            ours_free, _ = step_logits(model, prompts, max_new_tokens=n, prefill_chunks=case.prefill_chunks)
        session_info = session.describe()
    if model.config._attn_implementation != hf_previous:
        raise PagedWindowError("restore() did not bring back the model's attention implementation")
    result = DecodeResult(
        case=case, dtype=str(dtype).replace("torch.", ""), backend=backend, session=session_info, fused_prep=fused_prep
    )
    for i, prompt in enumerate(prompts):
        hf_tokens, hf_logits = hf[i]
        ours, sdpa = ours_tf[i], floor[i]
        stats, floor_stats = error_stats(ours, hf_logits), error_stats(sdpa, hf_logits)
        g = gate(stats, floor_stats, dtype)
        tol = g.limit * stats.ref_max if dtype in (torch.float32, torch.float64) else g.limit
        margins = top2_margin(hf_logits).tolist()
        clear = [margin_is_clear(m, tol) for m in margins]
        argmax = torch.argmax(ours, dim=-1).tolist()
        first_unclear = next((s for s, c in enumerate(clear) if not c), n)
        result.requests.append(
            RequestDecode(
                prompt=list(prompt),
                hf_tokens=hf_tokens,
                ours_tokens=ours_free[i],
                ours_tf_argmax=argmax,
                logit_err=(ours.double() - hf_logits.double()).abs().amax(dim=-1).tolist(),
                floor_err=(sdpa.double() - hf_logits.double()).abs().amax(dim=-1).tolist(),
                margin=margins,
                clear=clear,
                tol=tol,
                logits=stats,
                floor=floor_stats,
                logits_gate=g,
                tf_tokens_ok=all(a == t for a, t, c in zip(argmax, hf_tokens, clear) if c),
                free_tokens_ok=ours_free[i][:first_unclear] == hf_tokens[:first_unclear],
                first_unclear=first_unclear,
            )
        )
    return result
