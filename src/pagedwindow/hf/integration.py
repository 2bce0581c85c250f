"""Make an HF Gemma model run every attention layer through pagedwindow: ``use_pagedwindow(model)`` /
``restore(model)`` (or the ``pagedwindow_attention(model)`` context manager).

Registration: the attention function :func:`paged_attention_forward` under :data:`ATTN_IMPL` with
``transformers.AttentionInterface.register``, and a mask builder for the same name with
``AttentionMaskInterface.register`` (under a custom name without one, HF passes ``attention_mask=None``). Our mask
builder does not build a mask at all: it returns :class:`PagedRows`, which of the step's query rows are real tokens
(the last ``q_len`` columns of HF's 2D padding mask, or ``None`` when there is no padding). Visibility (causal and
window) is decided by pagedwindow from positions, not by a dense mask.

Per forward step (one call of the decoder stack; a forward pre-hook marks it), the first layer's call decides the
step: per request, the real rows and their positions. Positions come from the paged state (what each request
already holds); HF's ``position_ids`` are cross-checked against them (a mismatch raises ``PagedWindowError``). A
step whose every request starts at position 0 is a new sequence: the state is reset. Then every layer appends its
new K/V into the paged pool and attends through a plan (shuffled pages; ``sm_scale`` from HF's ``scaling``;
``window_left`` from HF's ``sliding_window`` through ``pw.window_left_from_sliding_window``; full layers -1).

HF's own KV cache — the choice made here: the new K/V are always taken as the **last ``q_len`` rows** of the
key/value HF hands us. Without an HF cache (``use_cache=False``) those are all the rows; with one (``generate``'s
default ``DynamicCache``), HF has already appended them to its cache and hands us ``cache + new`` (on sliding
layers only the last W rows of it) — we never read HF's cached rows, so nothing is fed twice and HF's truncation
of sliding layers cannot shift our positions. HF's cache is then dead weight (memory only); run with
``use_cache=False`` and explicit ``position_ids`` to avoid it (``decode_oracle.step_logits`` does). Static /
compileable caches (whose key tensor does not end with the new rows) are refused by the pre-hook, and so are
models whose layers share K/V (``num_kv_shared_layers > 0``).

Fused prep (``use_pagedwindow(model, fused_prep=True)``): each *sliding* layer's attention module runs
:func:`fused_sliding_forward` for the session (an instance ``forward``, removed by :func:`restore`): its q/k/v
projections go through ``PagedKvState.prepare_and_attend`` — ``pagedwindow.prepare_paged_qkv`` (Gemma 4:
``norm_style "gemma4"``, sm_scale 1; Gemma 3: ``"gemma3"``, sm_scale ``query_pre_attn_scalar ** -0.5``; the
sliding RoPE base; everything read and checked by :func:`~pagedwindow.hf._compat.sliding_prep`) writes the
normed, rotated K and the normed V into the pool, and attention reads them with the same plan — then HF's
``o_proj``. HF's norms, its RoPE (cos / sin) and its cache update never run on those layers; full layers keep
HF's forward and the attention function above. HF's cache would therefore miss the sliding layers' K/V: the
pre-hook refuses a forward with an HF cache or with ``use_cache`` on (pass ``use_cache=False``), and the fused
forward refuses one handed to it.

Padding: a batch of prompts of different lengths may be padded anywhere (left padding, as ``generate`` does, or
mid-sequence pads in chunked steps): pad rows are neither appended nor attended (their output rows are zero), so
each request's window counts its own tokens only.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from .. import PagedWindowError, window_left_from_sliding_window
from ..kv_state import PagedKvState, StepInfo
from ._compat import attention_geometry, attention_modules, decoder, register_attention, sliding_prep

ATTN_IMPL = "pagedwindow"


@dataclass(frozen=True)
class PagedRows:
    """What our mask builder hands the attention function: which of the step's query rows are real tokens.

    valid: bool ``[B, q_len]`` or ``None`` (every row real).
    """

    valid: torch.Tensor | None


def paged_mask(*, batch_size=None, q_length=None, attention_mask=None, **_ignored) -> PagedRows:
    """Mask builder registered for :data:`ATTN_IMPL`: returns :class:`PagedRows` from HF's 2D padding mask."""
    if attention_mask is None:
        return PagedRows(None)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise PagedWindowError(
            f"{ATTN_IMPL}: expected HF's 2D padding mask, got {type(attention_mask).__name__} "
            f"{tuple(getattr(attention_mask, 'shape', ()))}"
        )
    if q_length is None or attention_mask.shape[1] < q_length:
        raise PagedWindowError(f"{ATTN_IMPL}: 2D mask {tuple(attention_mask.shape)} shorter than q_len {q_length}")
    valid = attention_mask[:, attention_mask.shape[1] - q_length :].to(torch.bool)
    return PagedRows(None if bool(valid.all()) else valid)


def paged_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    scaling=None,
    sliding_window=None,
    dropout=0.0,
    softcap=None,
    position_ids=None,
    **kwargs,
):
    """HF attention-interface function: ``query [B, Hq, S, D]``, ``key/value [B, Hkv, Skv >= S, D]`` ->
    ``([B, S, Hq, D], None)``. Only the last S rows of key/value are used (the new tokens)."""
    session = getattr(module, "_pagedwindow_session", None)
    if session is None:
        raise PagedWindowError(f"{ATTN_IMPL} attention called on a model without a session: use_pagedwindow(model)")
    if dropout:
        raise PagedWindowError(f"{ATTN_IMPL}: attention dropout {dropout} is not supported (eval mode only)")
    if softcap is not None:
        raise PagedWindowError(f"{ATTN_IMPL}: attention logit softcap {softcap} is not supported")
    if not getattr(module, "is_causal", True):
        raise PagedWindowError(f"{ATTN_IMPL}: bidirectional attention is not supported")
    if scaling is None:
        raise PagedWindowError(f"{ATTN_IMPL}: HF passed no scaling; sm_scale must be explicit")
    rows = _check_attention_call(module, attention_mask)
    valid = rows.valid if rows is not None else None
    out = session.attend(
        int(module.layer_idx),
        query,
        key,
        value,
        valid=valid,
        position_ids=position_ids,
        sm_scale=float(scaling),
        sliding_window=sliding_window,
    )
    return out, None


def register() -> str:
    """Register the attention function and its mask builder under :data:`ATTN_IMPL` (idempotent)."""
    return register_attention(ATTN_IMPL, paged_attention_forward, paged_mask)


class PagedWindowSession:
    """The paged state of one model under :func:`use_pagedwindow`; persists across forward / generate steps.

    ``fused_prep``: the sliding layers run :func:`fused_sliding_forward` (``prep`` holds their
    :class:`~pagedwindow.hf._compat.LayerPrep`); the others HF's forward and :func:`paged_attention_forward`."""

    def __init__(
        self, model, *, backend: str, page_size: int, seed: int, initial_pages: int, poison: bool, fused_prep: bool
    ):
        self.model = model
        self.geometry = attention_geometry(model)
        self.fused_prep = bool(fused_prep)
        self.prep = sliding_prep(model) if self.fused_prep else {}
        self.state = PagedKvState(
            [(g.num_kv_heads, g.head_dim) for g in self.geometry],
            page_size=page_size,
            backend=backend,
            seed=seed,
            initial_pages=initial_pages,
            poison=poison,
        )
        self.backend = backend
        self.previous_impl = model.config._attn_implementation
        self.forward_steps = 0
        self.resets = 0
        self._step_pending = False
        self._rows: list[torch.Tensor] | None = None  # per request: index tensor of the real rows of the current step
        self._query_shape: tuple[int, int] | None = None  # (batch, query length) of the layers of the current step
        self._hook: RemovableHandle | None = None

    # -- step boundaries ---------------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        for name in ("cache", "past_key_values"):
            cache = kwargs.get(name)
            if cache is not None and getattr(cache, "is_compileable", False):
                raise PagedWindowError(
                    f"{ATTN_IMPL}: {type(cache).__name__} is a static/compileable cache; its key tensor does not "
                    "end with the new rows. Use the default DynamicCache or use_cache=False"
                )
        if self.fused_prep:
            self._refuse_hf_cache(module, kwargs)
        self._step_pending = True
        self.forward_steps += 1

    @staticmethod
    def _refuse_hf_cache(module, kwargs) -> None:
        """With fused prep HF's cache would miss the sliding layers' K/V: refuse one given, or one HF would make
        (``use_cache`` true, or unset with ``config.use_cache`` true)."""
        given = [name for name in ("cache", "past_key_values") if kwargs.get(name) is not None]
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", False)
        if given or use_cache:
            what = f"an HF cache was passed ({given[0]}=)" if given else "HF would build a KV cache (use_cache on)"
            raise PagedWindowError(
                f"{ATTN_IMPL} with fused_prep=True: {what}, but the fused sliding layers never update HF's cache "
                "(the paged pool holds their K/V). Pass use_cache=False (and explicit position_ids past the first "
                "step), e.g. model(input_ids, position_ids=..., use_cache=False) or generate(..., use_cache=False)"
            )

    def reset(self) -> None:
        """Forget every request (the next step must start at position 0)."""
        self.state.step = None
        self.state.batch_size = 0
        self._step_pending = True

    # -- the attention call ------------------------------------------------------------------------------------
    def _begin_step(self, bsz: int, s: int, device, valid, position_ids) -> None:
        if valid is None:
            rows = [torch.arange(s, device=device) for _ in range(bsz)]
        else:
            if tuple(valid.shape) != (bsz, s):
                raise PagedWindowError(f"{ATTN_IMPL}: padding rows {tuple(valid.shape)} for a query of {bsz}x{s}")
            rows = [torch.nonzero(valid[b], as_tuple=False).flatten() for b in range(bsz)]
        seq = [int(r.numel()) for r in rows]
        positions = None
        if position_ids is not None:
            pos = position_ids.expand(bsz, -1) if position_ids.shape[0] == 1 else position_ids
            if tuple(pos.shape) != (bsz, s):
                raise PagedWindowError(f"{ATTN_IMPL}: position_ids {tuple(position_ids.shape)} for {bsz}x{s} queries")
            positions = [pos[b, rows[b]].tolist() for b in range(bsz)]
        state = self.state
        fresh = state.batch_size != bsz  # a new batch (or the session was reset: batch size 0)
        # a new sequence: every request has rows and all start at 0 (a request merely waiting for its first chunk
        # has no rows in this step and keeps the others' state)
        starts_at_zero = positions is not None and all(p and p[0] == 0 for p in positions)
        new_sequence = fresh or starts_at_zero
        held = [0] * bsz if new_sequence else list(state.kv_lens)
        if positions is not None:  # checked before the state changes: a refused forward leaves it as it was
            for b, p in enumerate(positions):
                want = list(range(held[b], held[b] + len(p)))
                if p != want:
                    raise PagedWindowError(
                        f"{ATTN_IMPL}: request {b} holds {held[b]} tokens, so its new rows sit at "
                        f"positions {want[:3]}..., but HF passed position_ids {p[:3]}... (a skipped or repeated "
                        "step? with padding, pass position_ids as generate derives them: cumsum(mask) - 1)"
                    )
        if new_sequence:
            if not fresh:
                self.resets += 1
            state.reset(bsz)
        state.begin_step(seq)
        self._rows = rows
        self._query_shape = (bsz, s)
        self._step_pending = False

    @contextlib.contextmanager
    def _layer_call(self):
        """Around one layer's call, from the step's start to the state's feed: if it raises before any layer of
        the step was fed (a forward refused at its first layer), the step is taken back, so the requests hold
        what they held and the retry starts the step again."""
        try:
            yield
        except Exception:
            if self.state.step is not None and not self.state.fed_layers:
                self.state.abandon_step()
                self._step_pending = True
            raise

    def _enter_layer(self, layer: int, bsz: int, s: int, device, valid, position_ids) -> None:
        """Begin the step at the first layer of a forward; later layers must see the same batch."""
        if self._step_pending or self.state.step is None:
            self._begin_step(bsz, s, device, valid, position_ids)
        elif (bsz, s) != self._query_shape:
            raise PagedWindowError(
                f"{ATTN_IMPL}: layer {layer} query batch differs from the step's: {bsz}x{s}, the step began with "
                f"{self._query_shape}"
            )

    def _step_rows(self) -> tuple[StepInfo, list[torch.Tensor]]:
        """The current step and, per request, the index tensor of its real rows (both set by :meth:`_begin_step`)."""
        step, rows = self.state.step, self._rows
        if step is None or rows is None:
            raise PagedWindowError(f"{ATTN_IMPL}: no step begun (the first layer of a forward begins it)")
        return step, rows

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """The step's real rows of ``t [B, S, H, D]``, active requests in order: ``[T, H, D]``."""
        step, step_rows = self._step_rows()
        act = step.active
        if not act:
            return t.new_empty(0, t.shape[2], t.shape[3])
        return torch.cat([t[b][step_rows[b]] for b in act])

    def _scatter(self, rows: torch.Tensor, bsz: int, s: int, like: torch.Tensor) -> torch.Tensor:
        """``rows [T, Hq, D]`` back to ``[B, S, Hq, D]`` in ``like``'s dtype; pad rows are zero."""
        step, step_rows = self._step_rows()
        out = like.new_zeros(bsz, s, rows.shape[1], rows.shape[2])
        at = 0
        for b in step.active:
            n = step.seq[b]
            out[b, step_rows[b]] = rows[at : at + n].to(out.dtype)
            at += n
        return out

    def attend(self, layer: int, query, key, value, *, valid, position_ids, sm_scale: float, sliding_window):
        """HF's attention-function call: ``query [B, Hq, S, D]``, key/value ``[B, Hkv, Skv >= S, D]`` (after the
        norms and RoPE; the last S rows are the new ones) -> ``[B, S, Hq, D]``."""
        bsz, hq, s, d = query.shape
        if key.shape[2] < s or value.shape[2] < s:
            raise PagedWindowError(f"{ATTN_IMPL}: layer {layer} got {key.shape[2]} keys for {s} new rows")
        with self._layer_call():
            self._enter_layer(layer, bsz, s, query.device, valid, position_ids)
            new_k = key[:, :, key.shape[2] - s :].transpose(1, 2)  # [B, S, Hkv, D]
            new_v = value[:, :, value.shape[2] - s :].transpose(1, 2)
            q, k, v = self._gather(query.transpose(1, 2)), self._gather(new_k), self._gather(new_v)  # [T, H, D]
            out_rows = self.state.attend(
                layer, q, k, v, sm_scale=sm_scale, window_left=window_left_from_sliding_window(sliding_window)
            )
        return self._scatter(out_rows, bsz, s, query)

    def attend_fused(self, layer: int, q_proj, k_proj, v_proj, *, valid, position_ids) -> torch.Tensor:
        """A fused sliding layer's call: the projections ``q_proj [B, S, Hq, D]``, ``k_proj / v_proj
        [B, S, Hkv, D]`` (before the norms) through ``PagedKvState.prepare_and_attend`` with the layer's
        :class:`~pagedwindow.hf._compat.LayerPrep` -> ``[B, S, Hq, D]``."""
        prep = self.prep[layer]
        bsz, s = q_proj.shape[:2]
        with self._layer_call():
            self._enter_layer(layer, bsz, s, q_proj.device, valid, position_ids)
            out_rows = self.state.prepare_and_attend(
                layer,
                self._gather(q_proj),
                self._gather(k_proj),
                self._gather(v_proj),
                **prep.prep_kwargs(),
                sm_scale=prep.sm_scale,
                window_left=window_left_from_sliding_window(prep.sliding_window),
            )
        return self._scatter(out_rows, bsz, s, q_proj)

    def describe(self) -> dict:
        return {
            "backend": self.backend,
            "fused_prep": self.fused_prep,
            "fused_layers": sorted(self.prep),
            "forward_steps": self.forward_steps,
            "resets": self.resets,
            "state": self.state.describe(),
        }


def _check_attention_call(module, attention_mask) -> PagedRows | None:
    """The checks both attention paths share; returns the PagedRows (or None)."""
    if not getattr(module, "is_causal", True):
        raise PagedWindowError(f"{ATTN_IMPL}: bidirectional attention is not supported")
    if attention_mask is not None and not isinstance(attention_mask, PagedRows):
        raise PagedWindowError(
            f"{ATTN_IMPL}: attention_mask is a {type(attention_mask).__name__}, not the PagedRows our mask builder "
            "returns (a mask prepared for another implementation?)"
        )
    return attention_mask


def fused_sliding_forward(module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    """A sliding attention module's forward under ``use_pagedwindow(model, fused_prep=True)``, mirroring HF's
    ``Gemma4TextAttention`` / ``Gemma3Attention``: q/k/v projections -> our prep (norms, RoPE at the paged
    state's positions, K/V written into the pool) and our attention -> ``o_proj``. ``hidden_states [B, S, hidden]``
    -> ``([B, S, hidden], None)``. HF's ``position_embeddings`` (cos / sin) are not used: the prep computes RoPE
    from the positions the paged state holds, cross-checked against HF's ``position_ids`` like every layer's.
    Refuses an HF cache (it would miss this layer's K/V)."""
    session = getattr(module, "_pagedwindow_session", None)
    if session is None:
        raise PagedWindowError(f"{ATTN_IMPL} fused forward called on a model without a session: use_pagedwindow(model)")
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise PagedWindowError(
                f"{ATTN_IMPL} with fused_prep=True: layer {module.layer_idx} was handed an HF cache ({name}=); the "
                "fused layers never update it. Pass use_cache=False"
            )
    if module.training:
        raise PagedWindowError(f"{ATTN_IMPL} fused forward: layer {module.layer_idx} is in training mode (eval only)")
    rows = _check_attention_call(module, attention_mask)
    bsz, s = hidden_states.shape[:2]
    d = int(module.head_dim)
    q = module.q_proj(hidden_states).view(bsz, s, -1, d)  # [B, S, Hq, D]
    k = module.k_proj(hidden_states).view(bsz, s, -1, d)  # [B, S, Hkv, D]
    v_proj = getattr(module, "v_proj", None)
    v = v_proj(hidden_states).view(bsz, s, -1, d) if v_proj is not None else k  # [B, S, Hkv, D]
    out = session.attend_fused(
        int(module.layer_idx),
        q,
        k,
        v,
        valid=rows.valid if rows is not None else None,
        position_ids=kwargs.get("position_ids"),
    )  # [B, S, Hq, D]
    return module.o_proj(out.reshape(bsz, s, -1).contiguous()), None


def _install_fused(module) -> None:
    """Replace ``module.forward`` (for this instance) by :func:`fused_sliding_forward`; the previous instance
    attribute, if any, is kept for :func:`_remove_fused`."""
    module._pagedwindow_forward = module.__dict__.get("forward")
    module.forward = types.MethodType(fused_sliding_forward, module)


def _remove_fused(module) -> None:
    if not hasattr(module, "_pagedwindow_forward"):
        return
    previous = module._pagedwindow_forward
    del module.forward
    if previous is not None:
        module.forward = previous
    del module._pagedwindow_forward


def use_pagedwindow(
    model,
    *,
    backend: str = "auto",
    page_size: int = 16,
    seed: int = 0,
    initial_pages: int = 64,
    poison: bool = True,
    fused_prep: bool = False,
) -> PagedWindowSession:
    """Make ``model`` run every attention layer through pagedwindow; returns the session (its paged state).

    backend: "reference" | "cuda" | "auto" (pagedwindow's). page_size: tokens per page. seed: page shuffling.
    fused_prep: the sliding layers' attention modules run :func:`fused_sliding_forward` (projections ->
    ``prepare_paged_qkv`` + our attention -> ``o_proj``) instead of HF's norms and RoPE; the model's prep must be
    one the op reproduces (:func:`~pagedwindow.hf._compat.sliding_prep` checks, else ``PagedWindowError``), and
    every forward must run without an HF cache (``use_cache=False``). Full layers keep HF's forward.
    Undo with :func:`restore`. Calling it again on a model already using pagedwindow is an error.
    """
    register()
    if getattr(model, "_pagedwindow_session", None) is not None:
        raise PagedWindowError("use_pagedwindow: this model already uses pagedwindow (restore(model) first)")
    if getattr(model.config, "num_kv_shared_layers", 0):
        raise PagedWindowError("use_pagedwindow: models with num_kv_shared_layers > 0 are not supported")
    if model.training:
        raise PagedWindowError("use_pagedwindow: put the model in eval mode first")
    session = PagedWindowSession(
        model,
        backend=backend,
        page_size=page_size,
        seed=seed,
        initial_pages=initial_pages,
        poison=poison,
        fused_prep=fused_prep,
    )
    modules = attention_modules(model)
    for m in modules:
        m._pagedwindow_session = session
    try:
        for m in modules:
            if int(m.layer_idx) in session.prep:
                _install_fused(m)
        session._hook = decoder(model).register_forward_pre_hook(session._pre_forward, with_kwargs=True)
        model.set_attn_implementation(ATTN_IMPL)
    except Exception:
        if session._hook is not None:
            session._hook.remove()
        for m in modules:
            _remove_fused(m)
            del m._pagedwindow_session
        raise
    model._pagedwindow_session = session
    return session


def restore(model) -> None:
    """Undo :func:`use_pagedwindow`: the previous attention implementation, the modules' own forwards, no hook,
    no session."""
    session = getattr(model, "_pagedwindow_session", None)
    if session is None:
        raise PagedWindowError("restore: this model does not use pagedwindow")
    model.set_attn_implementation(session.previous_impl)
    if session._hook is not None:
        session._hook.remove()
    for m in attention_modules(model):
        _remove_fused(m)
        if hasattr(m, "_pagedwindow_session"):
            del m._pagedwindow_session
    del model._pagedwindow_session


@contextlib.contextmanager
def pagedwindow_attention(model, **kwargs):
    """``with pagedwindow_attention(model, backend=...) as session:`` — :func:`use_pagedwindow` then
    :func:`restore`, even on error."""
    session = use_pagedwindow(model, **kwargs)
    try:
        yield session
    finally:
        restore(model)
