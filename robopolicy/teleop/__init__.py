"""Teleoperation on the learning side: recording sessions (``robopolicy teleop``), interventions
over a running policy, and HG-DAgger refinement from them."""
