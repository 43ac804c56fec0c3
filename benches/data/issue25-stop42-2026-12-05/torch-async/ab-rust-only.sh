V=/root/.cache/dspark/torch-venv; SP=$V/lib/python3.11/site-packages/dspark
cd /tmp/probe
for r in 1 2 3; do for b in old new; do
  if [ $b = old ]; then cp old/dspark/_dspark*.so $SP/; else cp new/_dspark*.so $SP/; fi
  echo "== $b round $r"
  flock -x -o /work/measure.lock timeout 600 $V/bin/torchrun --standalone --nproc-per-node 2 probe2.py 2>&1 | grep -v "^W\|warn" | tail -2
done; done
cp new/_dspark*.so $SP/
echo DONE
