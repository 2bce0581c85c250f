#!/usr/bin/env bash
# Pack the peers' wheels (.whl/*.whl: FlashInfer and its tvm-ffi, 62 MiB as wheels) as one xz tarball of their
# installed files, .whl/peer-site.tar.xz (about 19 MB), which benchmarks/device_run.sh unpacks onto PYTHONPATH on
# the GPU machine: small enough to travel beside the repository in one device call. Usage: bash benchmarks/pack_peer_site.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for wheel in .whl/*.whl; do
  python3 -m zipfile -e "$wheel" "$work"
done
tar -cf - -C "$work" . | xz -T0 -6 > .whl/peer-site.tar.xz
echo ".whl/peer-site.tar.xz: $(du -h .whl/peer-site.tar.xz | cut -f1) from $(ls .whl/*.whl | wc -l) wheels"
