"""Kernel time of pagedwindow at each given tile for a few batch shapes (the tile policy's evidence).

``python3 benchmarks/tile_probe.py [--shapes "B,N,C,W;..."]`` prints one row per shape (the default set, or the
given ``requests,new,cached,window`` tuples): the policy's tile and the kernel ms at tiles 16, 64
and 128 (median of ``bench.median_ms`` over two input sets), each checked against the reference first.
"""

import argparse

import numpy as np
import torch

from pagedwindow import bench
from pagedwindow.tiles import tile_for_batch

SHAPES = (  # (requests, new tokens each, cached keys each, window_left)
    (1, 16, 0, 1023),
    (64, 16, 0, 1023),
    (512, 16, 0, 1023),
    (64, 16, 4096, 1023),
    (64, 8, 4096, 1023),
    (16, 32, 4096, 1023),
    (64, 32, 0, 1023),
    (1, 1024, 0, 0),
    (1, 1024, 32768, -1),
    (32, 64, 0, 1023),
    (1, 2048, 0, 1023),
    (2, 1024, 0, 1023),
    (4, 512, 4096, 1023),
    (128, 16, 1024, 1023),
)
TILES = (16, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help='"requests,new,cached,window;..." in place of the default set')
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in shape.split(",")) for shape in args.shapes.split(";"))
    device = torch.device("cuda")
    print("| requests | new | cached | window | policy tile | " + " | ".join(f"tile {t} ms" for t in TILES) + " |")
    print("|---|---|---|---|---|" + "---|" * len(TILES))
    for batch, new, cached, window in shapes:
        w = bench.Workload(f"probe_b{batch}_n{new}_c{cached}", (new,) * batch, (cached,) * batch, window, 16)
        policy, _ = tile_for_batch(
            np.array(w.seq_lens),
            bench.HQ // bench.HKV,
            bench.HKV,
            device,
            longest_kv_len=lambda keys=cached + new: keys,
        )
        cells = []
        for tile in TILES:
            gen = torch.Generator().manual_seed(0)
            sets = [bench.make_inputs(w, gen, device, tile) for _ in range(2)]
            want = bench.reference_output(w, sets[0])
            made = [bench.system_pagedwindow(w, inp) for inp in sets]
            for call, _ in made:
                call()
            torch.cuda.synchronize()
            err = (made[0][1]().float() - want).abs().max().item()
            ms = bench.median_ms([call for call, _ in made], 20)
            cells.append(f"{ms:.4f}" + ("" if err < 0.05 else f" (err {err:.3f})"))
            del sets, made
            torch.cuda.empty_cache()
        print(f"| {batch} | {new} | {cached} | {window} | {policy} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
