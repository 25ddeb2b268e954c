#!/bin/bash
# Runs on the device machine, from the checkout root, once per carried part (idempotent).
# Copies the part to /root/stage/ts; when all parts of manifest.json are there it assembles them,
# checks the sha256, installs the wheels into /tmp/ts-site (--no-index --no-deps --target), adds the
# shared libraries the device lacks, and writes /root/stage/ts-env.sh. Then: `source /root/stage/ts-env.sh`.
set -u
here=$(cd "$(dirname "$0")" && pwd)
S=/root/stage/ts; T=/tmp/ts-site; mkdir -p $S
cp "$here"/p[0-9]* $S/ 2>/dev/null
cp "$here/manifest.json" $S/ 2>/dev/null
if [ ! -f $T/.stage-ready ]; then
  parts=$(python3 -c "import json;print(' '.join(json.load(open('$S/manifest.json'))['parts']))")
  missing=""; for p in $parts; do [ -f $S/$p ] || missing="$missing $p"; done
  if [ -n "$missing" ]; then echo "have: $(cd $S && ls p[0-9]* 2>/dev/null | tr '\n' ' ') missing:$missing"; exit 0; fi
  want=$(python3 -c "import json;print(json.load(open('$S/manifest.json'))['sha256'])")
  (cd $S && for p in $parts; do cat $p; done) > $S/bundle.tar.xz
  got=$(sha256sum $S/bundle.tar.xz | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "CHECKSUM MISMATCH: re-carry the parts"; rm -f $S/p[0-9]* $S/bundle.tar.xz; exit 3; }
  rm -rf $S/x && mkdir -p $S/x
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1],'r:xz').extractall(sys.argv[2])" $S/bundle.tar.xz $S/x || { echo "EXTRACT FAILED"; exit 4; }
  rm -f $S/bundle.tar.xz $S/p[0-9]*
  rm -rf $T && mkdir -p $T
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $T $S/x/whl/*.whl 2>&1 | grep -v -i "already exists\|warning" | tail -5
  mkdir -p $T/_syslibs
  for f in $S/x/syslibs/*; do [ -e "$f" ] || continue; n=$(basename $f)
    ldconfig -p 2>/dev/null | grep -q "^\s*$n " || cp $f $T/_syslibs/; done
  rm -rf $S/x
  [ -d $T/tokenspeed ] && touch $T/.stage-ready || { echo "INSTALL FAILED"; exit 5; }
fi
cu13=$(python3 -c "import os,nvidia; [print(os.path.join(p,'cu13','lib')) for p in nvidia.__path__ if os.path.isdir(os.path.join(p,'cu13','lib'))]" 2>/dev/null | head -1)
cat > /root/stage/ts-env.sh <<ENV
# TokenSpeed only: the vLLM bundle's /tmp/site is deliberately NOT on this path.
export PYTHONPATH=$T:$T/nvidia_cutlass_dsl/dsl_packages
export PATH=$T/bin:\$PATH
export LD_LIBRARY_PATH=$T/_syslibs${cu13:+:$cu13}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
[ -z "\${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
export MC_FORCE_TCP=\${MC_FORCE_TCP:-1}
ENV
. /root/stage/ts-env.sh
ldd $T/mooncake/engine.so 2>/dev/null | grep "not found" | sed 's/^/mooncake missing lib: /'
out=$(python3 -c 'import tokenspeed, smg_grpc_servicer.tokenspeed; import torch, tokenspeed.version as v; print("READY tokenspeed", getattr(v, "__version__", "0.1.0"), "torch", torch.__version__, "gpus", torch.cuda.device_count(), "site /tmp/ts-site env /root/stage/ts-env.sh")' 2>&1); rc=$?
echo "$out" | grep -v -i "warn" | tail -3
[ $rc = 0 ] || { echo "IMPORT CHECK FAILED (rc=$rc)"; exit 6; }
