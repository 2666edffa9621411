"""`moerl launch`: run a moerl job through TorchX, on one machine (`local_cwd`) or on Amazon EKS (`kubernetes`).

    cli.py         `moerl launch CONFIG --scheduler ... [--dryrun]`
    plan.py        config -> TorchX apps + Kubernetes shaping; every check before anything is submitted
    components.py  the TorchX components `trainer` and `rollout` (also for `torchx run`)
    kubernetes.py  what TorchX 0.7 cannot say (capacity type, zone, tolerations, grace, hugepages, policies)
    node.py        what a pod runs: Ray head/join, the controller, the spot drain
    presets.py     EC2 instance types: GPUs, EFA devices, default pod requests
See docs/eks.md.
"""
