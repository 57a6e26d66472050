"""The multi-node launch scripts: recipes/accelerate/*_2x8gpu.yaml load through accelerate's own config
classes as two machines of 8 processes, and recipes/slurm/elbo_kto.sbatch is valid bash that runs the
pipeline's three commands with the configs that ship and writes out the environment NCCL needs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ACC = REPO / "recipes" / "accelerate"
SBATCH = REPO / "recipes" / "slurm" / "elbo_kto.sbatch"


@pytest.mark.parametrize("name, dist", [("fsdp2_2x8gpu", "FSDP"), ("ddp_2x8gpu", "MULTI_GPU")])
def test_two_node_accelerate_configs_load_as_two_machines_of_eight(name, dist):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    c = load_config_from_file(str(ACC / f"{name}.yaml"))
    assert isinstance(c, ClusterConfig)
    assert c.distributed_type == dist and c.num_machines == 2 and c.num_processes == 16  # all machines' processes
    assert c.machine_rank == 0 and c.rdzv_backend == "static" and c.same_network is True
    assert c.main_process_ip is None and c.main_process_port == 29500  # the address is given per job
    if dist == "FSDP":
        one = load_config_from_file(str(ACC / "fsdp_8gpu.yaml"))
        assert c.fsdp_config == one.fsdp_config  # the one-node FSDP2 set-up, spread over two nodes
        assert c.fsdp_config["fsdp_version"] == 2


def test_doctor_reads_the_two_node_config_as_16_processes():
    from dllm_align.training.memory import read_launch

    launch = read_launch(str(ACC / "fsdp2_2x8gpu.yaml"))
    assert launch.processes == 16 and launch.fsdp_version == 2


def test_slurm_template_is_valid_bash_and_runs_the_pipeline_across_nodes():
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the template"
    p = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    text = SBATCH.read_text()
    assert re.search(r"^#SBATCH --nodes=2$", text, re.M) and re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)
    assert "scontrol show hostnames" in text and '--machine_rank "$SLURM_NODEID"' in text
    for var in ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX",
                "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "HF_HOME"):
        assert re.search(rf"^\s*(# )?(export )?{var}=", text, re.M), var
    steps = re.findall(r'^launch "\$(\w+)" ([\w-]+) ', text, re.M)
    assert [s for _, s in steps] == ["precompute-ref", "train", "generate"]
    for cfg in re.findall(r"^(?:FSDP|DDP)_CONFIG=\$\{\w+:-([^}]+)\}", text, re.M):
        assert (REPO / cfg).is_file(), cfg
