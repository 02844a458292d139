"""Starting and attending a run: one pipeline of named stages (pipeline.py), the request it runs (request.py),
the events it tells (events.py), the job stages' work (job.py) and the attended run (attend.py)."""
from nodectl.launch.pipeline import Outcome, Stage, launch, stages_for
from nodectl.launch.request import LaunchRequest, launch_request

__all__ = ["LaunchRequest", "Outcome", "Stage", "launch", "launch_request", "stages_for"]
