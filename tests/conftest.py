import os

# Headless rendering for every test (EGL through Mesa on machines without a GPU).
os.environ.setdefault("MUJOCO_GL", "egl")
