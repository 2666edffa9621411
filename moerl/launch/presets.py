"""EC2 instance presets for `launch.instance_type`: what one node has, and what a pod asks for by default.

GPU and EFA counts: torchx's `torchx/specs/named_resources_aws.py` (upstream main, which cites
https://aws.amazon.com/ec2/instance-types/p5/ and /p6/): p5 32 EFA, p5en 16 (EFAv3, 3200 Gbps), p6-b200 8
(EFAv4, 8 x 400 Gbps); AWS's "EFA configuration for P5" example (docs.aws.amazon.com, efa-acc-inst-types)
also requests 32 EFA devices on a p5.48xlarge. A pod's default requests leave room for the kubelet's
reservation and the daemon sets (EFA and NVIDIA device plugins, VPC CNI, kube-proxy, CSI drivers).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULERS = ("local_cwd", "kubernetes")  # TorchX schedulers `moerl launch` runs on (here: torchx-free, for --help)


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpu: str  # accelerator model, for messages
    gpus: int
    efa: int  # EFA devices the EFA device plugin advertises (vpc.amazonaws.com/efa)
    vcpus: int
    memory_gib: int
    pod_cpus: float  # default CPU request of a whole-node pod
    pod_memory_gib: int  # default memory request of a whole-node pod


PRESETS: dict[str, InstanceType] = {p.name: p for p in [
    InstanceType("p5.48xlarge", "H100", 8, 32, 192, 2048, 180.0, 1800),
    InstanceType("p5en.48xlarge", "H200", 8, 16, 192, 2048, 180.0, 1800),
    InstanceType("p6-b200.48xlarge", "B200", 8, 8, 192, 2048, 180.0, 1800),
]}


def preset(name: str) -> InstanceType:
    if name not in PRESETS:
        raise KeyError(f"unknown instance type {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
