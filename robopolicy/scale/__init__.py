"""Scale beyond one process: torch DDP for training (:mod:`robopolicy.scale.ddp`) and Ray actors for
rollouts (:mod:`robopolicy.scale.ray_backend`). See docs/scale.md."""
