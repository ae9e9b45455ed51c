"""Constants of the cost and memory models (placeholders until ``python -m jacmode.calibrate``)."""

MACHINE = "placeholder"
COST = {
    "forward": {"call": 2e-4, "pass_ops": 1e-5, "vmap_ops": 1e-5, "pass_flops": 2e-11, "pass_bytes": 1e-10,
                "dir_flops": 3e-11, "dir_bytes": 2e-10, "result": 1e-9},
    "reverse": {"call": 3e-4, "pass_ops": 2e-5, "vmap_ops": 2e-5, "pass_flops": 2e-11, "pass_bytes": 1e-10,
                "dir_flops": 4e-11, "dir_bytes": 3e-10, "result": 1e-9},
}
MEMORY = {"jvp_live": 4.0, "vjp_tape": 1.5, "vjp_live": 4.0, "param_copies": 3.0}
