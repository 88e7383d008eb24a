"""Starting or joining Ray (`vidtune.trainer.ray_setup`): a local Ray started within a bounded
wait (`ray_start`), joining a cluster that asks for a token (`ray_auth`), a killed command's Ray
reaped (`ray_reaper`), Ray's fixed ports another process holds (`fixed_ports`), and the driver's
launch: the config checked before any worker starts, the workers' environment and the code they
are shipped (`launch`).

Imports the models and training rooms. Nothing is imported here.
"""
