"""The prefill kernels' online softmax emulated on the CPU, tile by tile, with and without a lazy reference max.

``python3 benchmarks/lazy_rescale_emulation.py [--thresholds none 0 2 4 8] [--logit-std 1 4 16] [--seeds 3]``

Per 64-key tile, as the kernels do it (log2 domain, P cast to bf16 before P·V, O and the row sum l in fp32): a
row's reference max m moves to the tile's running max when that exceeds m by more than the threshold T (``none``:
always, as the kernels do now), O and l are rescaled by exp2(m_old - m_new) when it moves, and
P = exp2(s·scale_log2 - m) <= 2^T.
For each T and logit spread (the standard deviation of q·k·sm_scale; the bench's inputs, randn q and K with
sm_scale 1.0 at head_dim 256, give 16) it prints the largest |out - fp64 attention| and the share of warp-tiles
(16 rows by one 64-key tile) in which some row's O would have to be rescaled: what a warp-uniform skip could save.
"""

import argparse

import torch

KEYS_PER_TILE = 64
ROWS_PER_WARP = 16


def emulate(threshold, logit_std, seed, rows=128, keys=1024, head_dim=256):
    """(max |out - reference|, share of warp-tiles that rescale) for one draw."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randn(n, head_dim, generator=gen).to(torch.bfloat16).float()

    q, k, v = draw(rows), draw(keys), draw(keys)
    scale = logit_std / head_dim**0.5  # q.k has standard deviation sqrt(head_dim)
    sl2 = scale * 1.4426950408889634
    s = q @ k.T  # [rows, keys] fp32
    m = torch.full((rows,), -float("inf"))
    row_sum = torch.zeros(rows)
    o = torch.zeros(rows, head_dim)
    rescaled = tiles = 0
    for j in range(0, keys, KEYS_PER_TILE):
        st = s[:, j : j + KEYS_PER_TILE]
        running = torch.maximum(m, st.max(1).values * sl2)
        move = torch.ones_like(m, dtype=torch.bool) if threshold is None else running > m + threshold
        ref = torch.where(move, running, m)
        mu = torch.where(ref == -float("inf"), torch.zeros_like(ref), ref)
        alpha = torch.where(move, torch.exp2(m - mu), torch.ones_like(m))
        p = torch.exp2(st * sl2 - mu[:, None])
        row_sum = row_sum * alpha + p.sum(1)
        o = o * alpha[:, None] + p.to(torch.bfloat16).float() @ v[j : j + KEYS_PER_TILE]
        m = ref
        warp_rescales = (alpha != 1).view(-1, ROWS_PER_WARP).any(1)
        rescaled += int(warp_rescales.sum())
        tiles += warp_rescales.numel()
    out = o / row_sum[:, None]
    want = torch.softmax(q.double() @ k.double().T * scale, 1) @ v.double()
    return (out.double() - want).abs().max().item(), rescaled / tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", nargs="*", default=["none", "0", "2", "4", "8"])
    parser.add_argument("--logit-std", nargs="*", type=float, default=[1.0, 4.0, 16.0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print("| threshold | logit std | max abs error (worst seed) | warp-tiles that rescale |")
    print("|---|---|---|---|")
    for t in args.thresholds:
        threshold = None if t == "none" else float(t)
        for std in args.logit_std:
            runs = [emulate(threshold, std, seed) for seed in range(args.seeds)]
            err = max(e for e, _ in runs)
            share = sum(f for _, f in runs) / len(runs)
            print(f"| {t} | {std:g} | {err:.2e} | {share:.2f} |")


if __name__ == "__main__":
    main()
