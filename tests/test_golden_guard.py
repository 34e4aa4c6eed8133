"""The golden cases again on the cpu-guard backend, against the cpu's recorded hashes: every debug-state case
of tiny-a (each recompute and offload policy), every single-process `ds4 train` case (recompute, bf16
mixed precision, --swap-optimizer, --swap-layer-input, checkpoints) and the `mpirun -np 2` ones (FSDP, FSDP
+ EP 2, in fp32 and bf16, with their sharded checkpoints). cpu-guard's buffers are unreachable from the host
outside its ops and copies (src/kernels/guard/guard.c), so these runs prove that the model, the optimizers,
the trainer, the offload store, the checkpoints and EP's all-to-alls (staged through host copies, as a
device's are) reach tensor bytes only through the backend, and with the cpu's bits; under mpirun FSDP's
shards, the gathered weights and gradients (mapped pieces of the model's reserved ranges) and the buffers of
their collectives are the backend's too, the collectives staged through host copies. The larger bench configs
and the plans stay with tests/test_golden.py: under the guard every op pays for its page protections, and a
plan touches no tensor memory."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.exit(subprocess.call([sys.executable, os.path.join(HERE, "test_golden.py"), *sys.argv[1:], "--device", "cpu-guard",
                          "--only", "tiny-a", "--only", "train/", "--only", "mpi/"]))
