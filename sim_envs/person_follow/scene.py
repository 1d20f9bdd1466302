"""MJCF builder for the person-following scene.

One model per env instance holds every slot the task can use (MAX_PEOPLE people, MAX_OBSTACLES
obstacles, the robot, four walls); an episode randomises sizes, colours, poses and lights by
writing model fields, so the model and its renderers are built once.

Everything that moves (robot, people, the target marker) is a mocap body: the scene is
kinematic and only needs ``mj_kinematics`` + ``mj_camlight`` before rendering or ray casting.

Geom groups: 0 static scene, 1 people, 3 robot body, 4 top-down-only markers. The egocentric
camera and the visibility rays see groups 0-2 only.
"""

from __future__ import annotations

import math

import numpy as np

ROOM_HALF = 8.0  # the room is a 16 m x 16 m square centred at the origin
WALL_HEIGHT = 2.5
WALL_THICK = 0.1
MAX_PEOPLE = 8  # target + up to 7 others
MAX_OBSTACLES = 8
N_BOX_OBSTACLES = 5  # obstacle slots 0..4 are boxes, the rest cylinders
ROBOT_RADIUS = 0.25
CAMERA_HEIGHT = 1.0
CAMERA_FORWARD = 0.22  # camera sits at the front edge of the robot
PERSON_RADIUS = 0.22  # footprint radius used for planning
HIDDEN_Z = -30.0  # unused slots are parked below the floor (and made transparent)

FRONT_GROUPS = (1, 1, 1, 0, 0, 0)  # what the egocentric camera and visibility rays see
TOPDOWN_GROUPS = (1, 1, 1, 1, 1, 0)

# Person part names, in the order of geoms inside a person body.
PERSON_PARTS = ("leg_l", "leg_r", "torso", "arm_l", "arm_r", "head", "hat")
SHIRT_PARTS = ("torso", "arm_l", "arm_r")
TROUSER_PARTS = ("leg_l", "leg_r")


def person_layout(height: float) -> dict[str, tuple[str, tuple[float, ...], tuple[float, float, float]]]:
    """Geom (type, size, pos) of each part for a person of ``height`` metres (hat excluded)."""
    h = float(height)
    head_r = 0.105
    leg_top = 0.50 * h
    leg_r = 0.072
    leg_half = 0.5 * (leg_top - 2 * leg_r)
    torso_bot, torso_top = 0.50 * h, h - 2 * head_r - 0.04
    torso_r = 0.16
    torso_half = max(0.02, 0.5 * (torso_top - torso_bot) - torso_r * 0.5)
    torso_z = 0.5 * (torso_bot + torso_top)
    arm_r = 0.055
    arm_half = 0.5 * (torso_top - torso_bot) * 0.75
    arm_z = torso_top - arm_half - arm_r
    head_z = h - head_r
    return {
        "leg_l": ("capsule", (leg_r, leg_half), (0.0, 0.09, leg_r + leg_half)),
        "leg_r": ("capsule", (leg_r, leg_half), (0.0, -0.09, leg_r + leg_half)),
        "torso": ("capsule", (torso_r, torso_half), (0.0, 0.0, torso_z)),
        "arm_l": ("capsule", (arm_r, arm_half), (0.0, 0.215, arm_z)),
        "arm_r": ("capsule", (arm_r, arm_half), (0.0, -0.215, arm_z)),
        "head": ("sphere", (head_r,), (0.0, 0.0, head_z)),
        "hat": ("cylinder", (0.125, 0.045), (0.0, 0.0, h - 0.02)),
    }


def geom_bounds(gtype: str, size: tuple[float, ...]) -> tuple[float, np.ndarray]:
    """(rbound, aabb half-extents) of a geom, to keep the model consistent after resizing."""
    if gtype == "sphere":
        r = size[0]
        return r, np.array([r, r, r])
    if gtype == "capsule":
        r, h = size[0], size[1]
        return r + h, np.array([r, r, r + h])
    if gtype == "cylinder":
        r, h = size[0], size[1]
        return math.hypot(r, h), np.array([r, r, h])
    if gtype == "box":
        s = np.array(size[:3], dtype=float)
        return float(np.linalg.norm(s)), s
    raise ValueError(gtype)


def _fmt(v) -> str:
    return " ".join(f"{float(x):.6g}" for x in v)


def build_mjcf(front_height: int, front_width: int, hfov_deg: float, render_size: int) -> str:
    """The scene's MJCF text; ``front_*`` sets the egocentric camera's aspect and FOV."""
    fovy = math.degrees(2.0 * math.atan(math.tan(math.radians(hfov_deg) / 2.0) * front_height / front_width))
    off = max(front_height, front_width, render_size * 2, 64)
    td_height = 2.0 * ROOM_HALF + 1.0
    td_fovy = 40.0
    td_z = 0.5 * td_height / math.tan(math.radians(td_fovy) / 2.0)
    parts = []
    parts.append(
        f"""<mujoco model="person_follow">
  <compiler angle="radian"/>
  <option timestep="0.1"/>
  <statistic extent="{2 * td_z:.3f}" center="0 0 1"/>
  <visual>
    <global offwidth="{off}" offheight="{off}"/>
    <quality shadowsize="0" offsamples="0" numslices="10" numstacks="5" numquads="1"/>
    <map znear="0.0015" zfar="1.5"/>
    <headlight ambient="0.35 0.35 0.35" diffuse="0.4 0.4 0.4" specular="0 0 0"/>
  </visual>
  <asset>
    <texture name="sky" type="skybox" builtin="gradient" rgb1="0.75 0.8 0.85" rgb2="0.35 0.38 0.42" width="32" height="32"/>
    <texture name="floor_tex" type="2d" builtin="checker" rgb1="1 1 1" rgb2="0.8 0.8 0.8" width="64" height="64"/>
    <material name="floor_mat" texture="floor_tex" texrepeat="8 8" texuniform="false" rgba="0.6 0.6 0.6 1"/>
  </asset>
  <worldbody>
    <light name="sun" directional="true" pos="0 0 10" dir="0.3 0.2 -1" diffuse="0.6 0.6 0.6" specular="0 0 0" castshadow="false"/>
    <camera name="topdown" pos="0 0 {td_z:.3f}" xyaxes="1 0 0 0 1 0" fovy="{td_fovy}"/>
    <geom name="floor" type="plane" size="{ROOM_HALF + 1} {ROOM_HALF + 1} 4" material="floor_mat" group="0"/>
"""
    )
    h = ROOM_HALF + WALL_THICK
    walls = {
        "wall_px": ((h, 0, WALL_HEIGHT / 2), (WALL_THICK, h + WALL_THICK, WALL_HEIGHT / 2)),
        "wall_nx": ((-h, 0, WALL_HEIGHT / 2), (WALL_THICK, h + WALL_THICK, WALL_HEIGHT / 2)),
        "wall_py": ((0, h, WALL_HEIGHT / 2), (h + WALL_THICK, WALL_THICK, WALL_HEIGHT / 2)),
        "wall_ny": ((0, -h, WALL_HEIGHT / 2), (h + WALL_THICK, WALL_THICK, WALL_HEIGHT / 2)),
    }
    for name, (pos, size) in walls.items():
        parts.append(f'    <geom name="{name}" type="box" pos="{_fmt(pos)}" size="{_fmt(size)}" rgba="0.8 0.8 0.75 1" group="0"/>\n')
    for k in range(MAX_OBSTACLES):
        if k < N_BOX_OBSTACLES:
            parts.append(f'    <geom name="obst{k}" type="box" pos="0 0 {HIDDEN_Z}" size="0.4 0.4 0.5" rgba="0.5 0.4 0.3 0" group="0"/>\n')
        else:
            parts.append(f'    <geom name="obst{k}" type="cylinder" pos="0 0 {HIDDEN_Z}" size="0.3 1.25" rgba="0.6 0.6 0.6 0" group="0"/>\n')
    # Robot: the base is only seen from above; the camera looks along the body's +x axis.
    parts.append(
        f"""    <body name="robot" mocap="true" pos="0 0 0">
      <geom name="robot_base" type="cylinder" size="{ROBOT_RADIUS} 0.15" pos="0 0 0.15" rgba="0.15 0.15 0.18 1" group="3" contype="0" conaffinity="0"/>
      <geom name="robot_nose" type="box" size="0.12 0.05 0.03" pos="0.16 0 0.32" rgba="0.95 0.5 0.05 1" group="3" contype="0" conaffinity="0"/>
      <geom name="robot_mast" type="cylinder" size="0.03 {CAMERA_HEIGHT / 2}" pos="{CAMERA_FORWARD - 0.05} 0 {CAMERA_HEIGHT / 2}" rgba="0.3 0.3 0.3 1" group="3" contype="0" conaffinity="0"/>
      <camera name="front" pos="{CAMERA_FORWARD} 0 {CAMERA_HEIGHT}" xyaxes="0 -1 0 0 0 1" fovy="{fovy:.6f}"/>
    </body>
    <body name="target_marker" mocap="true" pos="0 0 {HIDDEN_Z}">
      <geom name="target_ring" type="cylinder" size="0.45 0.005" pos="0 0 0.006" rgba="0.1 1.0 0.2 0.9" group="4" contype="0" conaffinity="0"/>
      <geom name="target_flag" type="sphere" size="0.12" pos="0 0 2.4" rgba="0.1 1.0 0.2 1" group="4" contype="0" conaffinity="0"/>
    </body>
"""
    )
    layout = person_layout(1.75)
    for i in range(MAX_PEOPLE):
        parts.append(f'    <body name="person{i}" mocap="true" pos="{3 * i} 0 {HIDDEN_Z}">\n')
        for part in PERSON_PARTS:
            gtype, size, pos = layout[part]
            parts.append(
                f'      <geom name="p{i}_{part}" type="{gtype}" size="{_fmt(size)}" pos="{_fmt(pos)}" '
                f'rgba="0.5 0.5 0.5 1" group="1" contype="0" conaffinity="0"/>\n'
            )
        parts.append("    </body>\n")
    parts.append("  </worldbody>\n</mujoco>\n")
    return "".join(parts)
