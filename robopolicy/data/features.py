"""Feature declarations of every robopolicy dataset, in LeRobot v3.0 terms, declared once.

A LeRobot feature is ``{"dtype": str, "shape": tuple, "names": list | None}``; cameras are
``dtype="video"`` with shape ``(H, W, 3)``. :func:`dataset_features` builds the full dict for an
env from its observation and action spaces plus the labels its oracle provides; the recorder,
the collectors, the importers and the training loader all read the key names from here.

Timestamps. LeRobot uses the ``timestamp`` column as the key into the episode's MP4 (frame ``i``
sits at ``i / fps`` in the video, and decoding checks it within ``tolerance_s``), so
``timestamp`` is the frame's slot on the nominal grid, ``frame_index / fps``. The real capture
time is never hidden: ``timing.wall_time`` holds the wall-clock seconds since the episode
started, ``timing.lateness`` how far behind its slot the frame arrived, and ``timing.late`` flags
frames later than the recorder's tolerance. A late frame is therefore recorded as late, and
lerobot's own loader still finds every video frame.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

# --- LeRobot's own keys -------------------------------------------------------------------
STATE = "observation.state"
ENV_STATE = "observation.environment_state"  # float32 (E,): low-dimensional scene state (arm envs' env_state=true)
IMAGE_PREFIX = "observation.images."
ACTION = "action"
TASK = "task"
TIMESTAMP = "timestamp"
FRAME_INDEX = "frame_index"
EPISODE_INDEX = "episode_index"
INDEX = "index"
TASK_INDEX = "task_index"

# --- robopolicy extras (one name for one thing, see DESIGN.md) ----------------------------
INTERVENTION = "intervention"  # bool (1,): a human or the oracle took over this step
ORACLE_ACTION = "oracle.action"  # clean oracle label, same shape as action (DART: action is noisy)
ORACLE_WAYPOINTS = "oracle.waypoints"  # (K, 3) robot-frame (x, y, yaw) targets, tracking tasks
TARGET_BOX = "label.target_box"  # (4,) float32 box of the target person in the front image
TARGET_VISIBLE = "label.target_visible"  # bool (1,)
FREE_RUN = "label.free_run"  # (9,) float32 tracking: how far the robot could drive along 9 bearings across the camera's view before touching an obstacle or wall (m, capped)
GOAL_POS = "label.goal_pos"  # (6,) float32 arm tasks: the named object's and target's xyz (world, m)
GOAL_REL = "label.goal_rel"  # (6,) float32 arm tasks: the same two points minus the tool-centre point (m)
GOAL_GRIP = "label.goal_grip"  # (6,) float32 arm tasks: the object minus the tool-centre point, the target's xyz
REWARD = "next.reward"  # float32 (1,): reward received after executing ``action``
DONE = "next.done"  # bool (1,): the episode ended after this step
SUCCESS = "next.success"  # bool (1,): task judged successful after this step
WALL_TIME = "timing.wall_time"  # float64 (1,): seconds since episode start, real clock
LATENESS = "timing.lateness"  # float32 (1,): wall_time - frame_index / fps (>0: behind)
LATE = "timing.late"  # bool (1,): lateness above the recorder's tolerance

LABEL_KEYS = (ORACLE_ACTION, ORACLE_WAYPOINTS, TARGET_BOX, TARGET_VISIBLE, FREE_RUN, GOAL_POS, GOAL_REL, GOAL_GRIP)
TIMING_KEYS = (WALL_TIME, LATENESS, LATE)
# Written by the recorder on every frame, whatever the env.
ALWAYS_KEYS = (INTERVENTION, REWARD, DONE, SUCCESS) + TIMING_KEYS

# Per-episode columns added to meta/episodes (LeRobot keeps extra metadata per episode).
EPISODE_SUCCESS = "robopolicy/success"
EPISODE_SEED = "robopolicy/seed"
EPISODE_LATE_FRAMES = "robopolicy/late_frames"
EPISODE_MAX_LATENESS = "robopolicy/max_lateness_s"


def scalar(dtype: str) -> dict[str, Any]:
    """A per-frame scalar feature (LeRobot stores scalars with shape (1,))."""
    return {"dtype": dtype, "shape": (1,), "names": None}


def vector(n: int | tuple[int, ...], dtype: str = "float32", names: list[str] | None = None) -> dict[str, Any]:
    """A float vector or small array feature."""
    shape = (n,) if isinstance(n, int) else tuple(n)
    return {"dtype": dtype, "shape": shape, "names": names}


def camera(height: int, width: int, video: bool = True) -> dict[str, Any]:
    """An RGB camera stored as MP4 (``video``) or as PNG images in parquet."""
    return {"dtype": "video" if video else "image", "shape": (height, width, 3),
            "names": ["height", "width", "channels"]}


EXTRA_FEATURES: dict[str, dict[str, Any]] = {
    INTERVENTION: scalar("bool"),
    REWARD: scalar("float32"),
    DONE: scalar("bool"),
    SUCCESS: scalar("bool"),
    WALL_TIME: scalar("float64"),
    LATENESS: scalar("float32"),
    LATE: scalar("bool"),
}


def _space_shape(space: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in space.shape)


def dataset_features(
    observation_space: Any,
    action_space: Any,
    labels: Mapping[str, tuple[int, ...]] | None = None,
    use_videos: bool = True,
) -> dict[str, dict[str, Any]]:
    """LeRobot features for an env: cameras, state, action, the extras and the given labels.

    ``observation_space`` is a gymnasium ``Dict`` (or a plain mapping of spaces) with LeRobot
    keys; ``task`` entries are skipped (LeRobot stores the task text itself). ``labels`` maps a
    label key (one of :data:`LABEL_KEYS`) to its shape, e.g. ``{ORACLE_WAYPOINTS: (8, 3)}``;
    ``oracle.action`` is always declared with the action's shape.
    """
    spaces = getattr(observation_space, "spaces", observation_space)
    features: dict[str, dict[str, Any]] = {}
    for key, space in spaces.items():
        if key == TASK:
            continue
        shape = _space_shape(space)
        if key.startswith(IMAGE_PREFIX):
            if len(shape) != 3 or shape[-1] != 3:
                raise ValueError(f"camera {key!r} must be (H, W, 3) uint8, got shape {shape}")
            features[key] = camera(shape[0], shape[1], video=use_videos)
        elif key.startswith("observation."):
            features[key] = vector(shape, "float32")
        else:
            raise ValueError(f"observation key {key!r} is not a LeRobot key (observation.state, "
                             f"observation.images.<camera>, observation.<name>)")
    features[ACTION] = vector(_space_shape(action_space), "float32")
    features[ORACLE_ACTION] = vector(_space_shape(action_space), "float32")
    for key, shape in (labels or {}).items():
        if key not in LABEL_KEYS:
            raise ValueError(f"unknown label {key!r}; declared labels: {list(LABEL_KEYS)}")
        if key == ORACLE_ACTION:
            continue
        features[key] = scalar("bool") if key == TARGET_VISIBLE else vector(tuple(shape), "float32")
    features.update(EXTRA_FEATURES)
    return features


def env_features(env: Any, use_videos: bool = True) -> dict[str, dict[str, Any]]:
    """Features of a robopolicy env, with the labels its task provides.

    PersonFollow (its info carries ``target_box``) gets waypoints (K=8) and grounding labels;
    other tasks get ``oracle.action`` only. ``env.unwrapped.label_shapes`` (a mapping like the
    ``labels`` argument of :func:`dataset_features`), when an env defines it, wins.
    """
    base = getattr(env, "unwrapped", env)
    labels = getattr(base, "label_shapes", None)
    if labels is None:
        labels = {}
        if "PersonFollow" in type(base).__name__:
            labels = {ORACLE_WAYPOINTS: (8, 3), TARGET_BOX: (4,), TARGET_VISIBLE: (1,), FREE_RUN: (9,)}  # 9: the env's FREE_RUN_RAYS
    return dataset_features(env.observation_space, env.action_space, labels, use_videos=use_videos)


def camera_keys(features: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Keys of the camera features (video or image), in declaration order."""
    return [k for k, ft in features.items() if ft["dtype"] in ("video", "image")]


def frame_value(key: str, value: Any, feature: Mapping[str, Any]) -> np.ndarray:
    """Cast a raw value to what LeRobot's ``add_frame`` expects for ``feature`` (dtype, shape).

    Raises ValueError naming the key when the shape does not fit.
    """
    dtype = feature["dtype"]
    if dtype in ("video", "image"):
        arr = np.asarray(value)
        if arr.dtype != np.uint8:
            raise ValueError(f"feature {key!r}: camera frames must be uint8, got {arr.dtype}")
        if arr.shape != tuple(feature["shape"]):
            raise ValueError(f"feature {key!r}: expected image shape {tuple(feature['shape'])}, got {arr.shape}")
        return arr
    arr = np.asarray(value, dtype=dtype)
    shape = tuple(feature["shape"])
    if arr.shape != shape:
        if arr.size == int(np.prod(shape)) and (arr.ndim == 0 or shape == (1,)):
            arr = arr.reshape(shape)
        else:
            raise ValueError(f"feature {key!r}: expected shape {shape}, got {arr.shape}")
    return arr


def robot_frame(obs: Mapping[str, Any], action: np.ndarray) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A robot's observation and the command sent as one dataset frame, with its feature declarations.

    Carries ``observation.state``, ``action``, every camera and the scene state if the robot has one;
    recorders add their own keys (intervention, chunks, faults) to both dicts.
    """
    state = np.asarray(obs[STATE], np.float32)
    action = np.asarray(action, np.float32)
    frame: dict[str, Any] = {STATE: state, ACTION: action}
    features: dict[str, dict[str, Any]] = {STATE: vector(state.shape[0]), ACTION: vector(action.shape[0])}
    for key, value in obs.items():
        if key.startswith(IMAGE_PREFIX):
            frame[key] = value
            features[key] = camera(value.shape[0], value.shape[1])
        elif key == ENV_STATE:
            frame[key] = np.asarray(value, np.float32)
            features[key] = vector(np.shape(value)[0])
    return frame, features
