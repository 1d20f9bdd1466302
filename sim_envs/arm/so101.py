"""MJCF builder for a desktop arm modelled on the SO-101 (SO-ARM100 family), plus its table scene.

Everything is built from MuJoCo primitives (no meshes) so the scene loads anywhere and renders fast.

Kinematics (approximating the real SO-101; zero pose = upper arm vertical, forearm horizontal
pointing +x, gripper pointing straight down):

==============  =========================  ==============================================
joint           axis                       range
==============  =========================  ==============================================
shoulder_pan    world z, at the base top   ±110°
shoulder_lift   horizontal (y), z=0.095 m  ±100°  (positive leans forward)
elbow_flex      y, 0.116 m up the arm      ±100°  (positive bends the forearm down)
wrist_flex      y, 0.135 m along forearm   ±100°  (0 = gripper perpendicular to forearm)
wrist_roll      along the gripper axis     ±160°
gripper         virtual angle 0..100°      0 = closed, 1.745 rad = fully open (5 cm gap)
==============  =========================  ==============================================

Link lengths: base height 0.06 m (+0.035 m shoulder bracket), upper arm 0.116 m, forearm 0.135 m,
wrist axis to the tool centre point (between the finger pads) 0.093 m, to the finger tips 0.105 m.
The gripper is a parallel jaw: two fingers on slide joints, each driven by a position actuator
whose target is ``GRIP_M_PER_RAD × gripper angle`` (the ``gripper`` value in the observation is
the mean finger opening converted back to that angle). Grasping is by friction only.
The gripper pointing straight down means ``shoulder_lift + elbow_flex + wrist_flex = 0``.

World frame: the table top is z = 0, the arm base is at the origin and faces +x.

Physics: timestep 0.01 s × 5 substeps per 20 Hz control step, implicitfast integrator,
pyramidal friction cones (impratio 5). Arm links carry gravity compensation (like the servo
firmware holding pose) and only the gripper (palm, pads) collides. Joint servos are position
actuators (kp 30/40/40/20/10 N·m/rad, force limits 4/6/6/3/2 N·m); each finger is a
position actuator (kp 300 N/m, ±8 N). Cubes are 2.5 cm, 20 g; pad friction 1.5. The envs
switch MuJoCo's noslip solver on (``NOSLIP_ITERATIONS``) only while the fingers squeeze an
object, which keeps fast, jerky carries from slipping at this timestep.
"""

from __future__ import annotations

import numpy as np

ARM_JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll")
JOINT_NAMES = ARM_JOINTS + ("gripper",)
JOINT_LOW = np.array([-1.92, -1.745, -1.745, -1.745, -2.79, 0.0])
JOINT_HIGH = np.array([1.92, 1.745, 1.745, 1.745, 2.79, 1.745])

BASE_HEIGHT = 0.06
SHOULDER_Z = 0.095
UPPER_ARM = 0.116
FOREARM = 0.135
WRIST_TO_TCP = 0.093
WRIST_TO_TIP = 0.105
FINGER_TRAVEL = 0.025  # per finger, metres
GRIP_M_PER_RAD = FINGER_TRAVEL / JOINT_HIGH[5]
PAD_HALF = (0.013, 0.004, 0.014)  # along gripper axis, closing direction, width
PAD_INNER_GAP = 0.002  # inner face offset from the centre when the finger is closed

CUBE_HALF = 0.0125  # 2.5 cm cubes
BOWL_RADIUS = 0.035  # inner radius of the shallow bowls
BOWL_WALL_H = 0.012
ZONE_RADIUS = 0.04  # push target zone
MARKER_RADIUS = 0.012  # reach target marker

TIMESTEP = 0.01
N_SUBSTEPS = 5  # 20 Hz control
# Grasp stability at this timestep comes from the noslip solver; the envs switch it on only
# while the fingers squeeze something (commanded closed beyond where they are stopped), as it
# costs ~40 % of the step time.
NOSLIP_ITERATIONS = 3
CONTROL_DT = TIMESTEP * N_SUBSTEPS

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.12, 0.12),
    "green": (0.12, 0.65, 0.2),
    "blue": (0.12, 0.3, 0.9),
    "yellow": (0.95, 0.82, 0.08),
    "purple": (0.55, 0.2, 0.75),
    "orange": (1.0, 0.5, 0.05),
}
COLOR_NAMES = tuple(COLORS)


def _look_at(pos, target, up=(0.0, 0.0, 1.0)) -> str:
    """MuJoCo ``xyaxes`` for a camera at ``pos`` looking at ``target``."""
    pos, target, up = (np.asarray(v, dtype=float) for v in (pos, target, up))
    f = target - pos
    f /= np.linalg.norm(f)
    right = np.cross(f, up)
    right /= np.linalg.norm(right)
    cam_up = np.cross(right, f)
    return " ".join(f"{v:.5f}" for v in (*right, *cam_up))


def _fmt(v) -> str:
    return " ".join(f"{float(x):.6g}" for x in v)


def arm_xml(with_cameras: bool = True) -> str:
    """The arm as an MJCF ``<body>`` tree (attached to the worldbody)."""
    pad_x, pad_y, pad_z = PAD_HALF
    wrist_cam = ""
    if with_cameras:
        # In the gripper frame x points along the gripper; when it points down +z faces away
        # from the robot. The camera sits behind/above the jaws and looks past the finger tips.
        cam_pos = (0.035, 0.0, -0.045)
        wrist_cam = (
            f'<camera name="wrist" pos="{_fmt(cam_pos)}" fovy="75" '
            f'xyaxes="{_look_at(cam_pos, (0.13, 0.0, 0.0), up=(0, 0, 1))}"/>'
        )
    finger = ""
    for side, sign in (("left", 1), ("right", -1)):
        axis = f"0 {sign} 0"
        finger += f"""
            <body name="finger_{side}" pos="0 {sign * PAD_INNER_GAP} 0">
              <joint name="finger_{side}" type="slide" axis="{axis}" range="0 {FINGER_TRAVEL}"
                     damping="8" armature="0.02"/>
              <geom name="finger_{side}_link" type="box" class="visual" size="0.03 0.003 0.008"
                    pos="0.06 {sign * (pad_y + 0.002)} 0" rgba="0.15 0.15 0.15 1"/>
              <geom name="pad_{side}" type="box" class="grip" size="{pad_x} {pad_y} {pad_z}"
                    pos="{WRIST_TO_TCP} {sign * pad_y} 0" rgba="0.2 0.2 0.2 1"/>
            </body>"""
    return f"""
    <body name="base" pos="0 0 0">
      <geom type="cylinder" class="visual" size="0.045 {BASE_HEIGHT / 2}" pos="0 0 {BASE_HEIGHT / 2}" rgba="0.95 0.95 0.95 1"/>
      <body name="shoulder" pos="0 0 {BASE_HEIGHT}" gravcomp="1">
        <joint name="shoulder_pan" axis="0 0 1" range="{JOINT_LOW[0]} {JOINT_HIGH[0]}"/>
        <geom type="box" class="visual" size="0.025 0.03 0.02" pos="0 0 0.02" rgba="0.95 0.6 0.1 1"/>
        <body name="upper_arm" pos="0 0 {SHOULDER_Z - BASE_HEIGHT}" gravcomp="1">
          <joint name="shoulder_lift" axis="0 1 0" range="{JOINT_LOW[1]} {JOINT_HIGH[1]}"/>
          <geom type="capsule" class="visual" size="0.017" fromto="0 0 0 0 0 {UPPER_ARM}" rgba="0.95 0.6 0.1 1"/>
          <body name="forearm" pos="0 0 {UPPER_ARM}" gravcomp="1">
            <joint name="elbow_flex" axis="0 1 0" range="{JOINT_LOW[2]} {JOINT_HIGH[2]}"/>
            <geom type="capsule" class="visual" size="0.015" fromto="0 0 0 {FOREARM} 0 0" rgba="0.95 0.95 0.95 1"/>
            <body name="wrist" pos="{FOREARM} 0 0" quat="0.70710678 0 0.70710678 0" gravcomp="1">
              <joint name="wrist_flex" axis="0 1 0" range="{JOINT_LOW[3]} {JOINT_HIGH[3]}"/>
              <geom type="box" class="visual" size="0.02 0.018 0.016" pos="0.01 0 0" rgba="0.95 0.6 0.1 1"/>
              <body name="gripper" pos="0 0 0" gravcomp="1">
                <joint name="wrist_roll" axis="1 0 0" range="{JOINT_LOW[4]} {JOINT_HIGH[4]}"/>
                <geom name="palm" type="box" class="grip" size="0.012 0.03 0.015" pos="0.045 0 0" rgba="0.95 0.95 0.95 1"/>
                <site name="tcp" pos="{WRIST_TO_TCP} 0 0" size="0.004" rgba="1 0 1 0"/>
                {wrist_cam}
                {finger}
              </body>
            </body>
          </body>
        </body>
      </body>
    </body>"""


def actuators_xml() -> str:
    arm = "".join(
        f'<position name="{j}" joint="{j}" kp="{kp}" forcerange="-{f} {f}" ctrlrange="{lo} {hi}"/>'
        for j, kp, f, lo, hi in zip(
            ARM_JOINTS, (30, 40, 40, 20, 10), (4, 6, 6, 3, 2), JOINT_LOW[:5], JOINT_HIGH[:5]
        )
    )
    grip = "".join(
        f'<position name="finger_{s}" joint="finger_{s}" kp="300" forcerange="-8 8" ctrlrange="0 {FINGER_TRAVEL}"/>'
        for s in ("left", "right")
    )
    return f"<actuator>{arm}{grip}</actuator>"


def _defaults() -> str:
    return """
  <default>
    <joint damping="1.0" armature="0.01" limited="true"/>
    <geom contype="1" conaffinity="1" friction="1.0 0.01 0.001" solref="0.02 1"/>
    <default class="visual"><geom contype="0" conaffinity="0" group="1" density="300"/></default>
    <default class="grip"><geom contype="1" conaffinity="1" group="2" density="600" friction="1.5 0.02 0.001"/></default>
    <default class="marker"><geom contype="0" conaffinity="0" group="1" density="0"/></default>
  </default>"""


# Visual-only objects for domain randomisation (sim_envs.randomization): no contact, no mass, hidden in
# geom group 4 (renderers show groups 0-2) until the randomisation shows and places some at reset. Mocap
# bodies after every other body, so no other geom's, body's or mocap body's index moves.
_DISTRACTOR_GEOMS = ('type="sphere" size="0.012"', 'type="cylinder" size="0.013 0.012"',
                     'type="ellipsoid" size="0.022 0.012 0.009"', 'type="capsule" size="0.008 0.012"')
DISTRACTORS_XML = "".join(
    f'<body name="distractor{i}" mocap="true" pos="0 0 -0.5"><geom name="distractor{i}" {g} contype="0" '
    f'conaffinity="0" group="4" density="0" rgba="0.5 0.5 0.5 1"/></body>' for i, g in enumerate(_DISTRACTOR_GEOMS))


def scene_xml(task: str, num_cubes: int = 0, num_targets: int = 1, with_cameras: bool = True) -> str:
    """Full scene: table, arm, cubes (free bodies) and targets of ``task`` (reach/push/pickplace).

    Object colours are set at reset through ``model.geom_rgba``; positions through qpos/mocap.
    Targets are mocap bodies: reach markers are floating spheres, push zones flat discs,
    pick-and-place targets shallow bowls (a disc with a ring of eight low walls).
    """
    if task not in ("reach", "push", "pickplace", "arm"):
        raise ValueError(f"unknown arm scene {task!r}")
    cubes = ""
    for i in range(num_cubes):
        cubes += f"""
    <body name="cube{i}" pos="{0.2 + 0.05 * i} 0.3 {CUBE_HALF}">
      <freejoint name="cube{i}"/>
      <geom name="cube{i}" type="box" size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" mass="0.02" rgba="0.8 0.1 0.1 1"/>
    </body>"""
    targets = ""
    for i in range(num_targets if task != "arm" else 0):
        if task == "reach":
            geoms = f'<geom name="target{i}" class="marker" type="sphere" size="{MARKER_RADIUS}" rgba="1 0 0 0.8"/>'
        elif task == "push":
            geoms = f'<geom name="target{i}" class="marker" type="cylinder" size="{ZONE_RADIUS} 0.001" pos="0 0 0.001" rgba="1 0 0 1"/>'
        else:
            geoms = f'<geom name="target{i}" class="marker" type="cylinder" size="{BOWL_RADIUS + 0.004} 0.0015" pos="0 0 0.0015" rgba="1 0 0 1"/>'
            n_walls = 8
            r = BOWL_RADIUS + 0.002
            half_len = r * np.tan(np.pi / n_walls) + 0.002
            for k in range(n_walls):
                a = 2 * np.pi * k / n_walls
                geoms += (
                    f'<geom name="bowl{i}_wall{k}" type="box" size="0.002 {half_len:.5f} {BOWL_WALL_H / 2}" '
                    f'pos="{r * np.cos(a):.5f} {r * np.sin(a):.5f} {BOWL_WALL_H / 2}" euler="0 0 {a:.5f}" rgba="1 0 0 1"/>'
                )
        targets += f"""
    <body name="target{i}" mocap="true" pos="{0.2 + 0.1 * i} -0.3 0">{geoms}</body>"""
    cams = ""
    if with_cameras:
        front_pos, front_at = (0.52, 0.0, 0.32), (0.17, 0.0, 0.02)
        top_pos, top_at = (0.18, 0.0, 0.62), (0.18, 0.0, 0.0)
        cams = (
            f'<camera name="front" pos="{_fmt(front_pos)}" fovy="55" xyaxes="{_look_at(front_pos, front_at)}"/>'
            f'<camera name="topdown" pos="{_fmt(top_pos)}" fovy="50" xyaxes="0 -1 0 1 0 0"/>'
        )
    return f"""<mujoco model="so101_{task}">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{TIMESTEP}" integrator="implicitfast" impratio="5" cone="pyramidal"/>
  <visual>
    <quality shadowsize="0" offsamples="0" numslices="12" numstacks="6" numquads="1"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.5 0.5 0.5" specular="0 0 0"/>
    <global offwidth="640" offheight="480"/>
  </visual>
  {_defaults()}
  <worldbody>
    <light name="sun" pos="0.2 0 1.0" dir="0 0 -1" directional="true" castshadow="false" diffuse="0.4 0.4 0.4"/>
    <geom name="table" type="plane" size="1.5 1.5 0.5" pos="0.15 0 0" rgba="0.72 0.6 0.45 1"/>
    {cams}
    {arm_xml(with_cameras)}
    {cubes}
    {targets}
    {DISTRACTORS_XML}
  </worldbody>
  {actuators_xml()}
</mujoco>"""
