"""GPU checks for a lent machine: gpu_check.sh (the plan a lease runs), the wheels it carries (gpu_wheels.sh),
the GPU benchmark, a served check and host-time profilers."""
