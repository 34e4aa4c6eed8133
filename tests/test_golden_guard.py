"""The golden cases again on the cpu-guard backend, against the cpu's recorded hashes: every debug-state case
of tiny-a (each recompute and offload policy) and every single-process `ds4 train` case (recompute, bf16
mixed precision, --swap-optimizer, --swap-layer-input, checkpoints). cpu-guard's buffers are unreachable from
the host outside its ops and copies (src/kernels/guard/guard.c), so these runs prove that the model, the
optimizers, the trainer, the offload store and the checkpoints reach tensor bytes only through the backend,
and with the cpu's bits. The larger bench configs and the plans stay with tests/test_golden.py: under the
guard every op pays for its page protections, and a plan touches no tensor memory."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.exit(subprocess.call([sys.executable, os.path.join(HERE, "test_golden.py"), *sys.argv[1:], "--device", "cpu-guard",
                          "--only", "tiny-a", "--only", "train/"]))
