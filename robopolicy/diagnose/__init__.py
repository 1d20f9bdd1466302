"""Diagnostics: run a policy on evaluation seeds, one env, and break down how its episodes end.

    robopolicy diagnose pickplace-failures --checkpoint outputs/train/arm_state_75/final
    robopolicy diagnose tracking-failures --checkpoint outputs/train/track_stage3/final --split dt

One module per diagnostic; each has a config dataclass, ``diagnose(cfg) -> dict`` (the counts and
measurements, JSON-ready) and ``report(result) -> list[str]`` (the printed table and summary).
:mod:`robopolicy.diagnose.stepping` steps one policy in one env through the evaluation's own
pieces (policy runner, chunk executor, env kwargs fitted to the checkpoint), so a diagnosis
sees the episodes ``robopolicy eval`` scores.
"""
