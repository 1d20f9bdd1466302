"""Deployment: the policy worker process and the ``robopolicy run`` loop around the control node."""
