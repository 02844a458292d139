"""How an attached launch watches its run is declared once (nodectl/launch/attending.py): each field of
`Attending` is the command line's option, the request's value and the run record's, and --resume reads the record
back as the command line would have taken it."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

import click
import pytest
from click.testing import CliRunner

from nodectl.cli.options import declared_options
from nodectl.errors import UsageError
from nodectl.launch.attending import Attending, option
from nodectl.runs import Manifest


def test_every_field_is_an_option_of_launch_taken_and_recorded_as_declared():
    from nodectl.cli import main

    shown = CliRunner().invoke(main, ["launch", "--help"], terminal_width=200).output
    for f in fields(Attending):
        assert f.metadata["option"].flag in shown, f.name
    given = {"grace": 3.0, "max_restarts": 2, "exclude_failed": True, "stall_after": 30.0, "on_stall": "keep",
             "on_straggler": "exclude", "straggler_hold": 5.0, "dry_run": False}
    attending = Attending.take(given)
    assert given == {"dry_run": False} and attending.keep_stalled and attending.max_restarts == 2
    assert Attending.from_record(json.loads(json.dumps(attending.to_json())), "record") == attending


def test_a_new_option_is_one_field():
    """What a newcomer writes to add one: a field with its option; the click option, the value taken from the
    command's options and the record's key follow from it."""
    @dataclass(frozen=True)
    class Watching(Attending):
        report_every: float = option(30.0, "--report-every", "Seconds between progress lines.", "seconds", low=1)

    seen = {}

    @click.command()
    @declared_options(Watching)
    def command(**options):
        seen.update(vars(Watching.take(options)))

    assert CliRunner().invoke(command, ["--report-every", "5", "--max-restarts", "1"]).exit_code == 0
    assert seen["report_every"] == 5.0 and seen["max_restarts"] == 1 and seen["grace"] == 10.0
    refused = CliRunner().invoke(command, ["--report-every", "0.5"])
    assert refused.exit_code == 2 and "--report-every" in refused.output
    assert Watching.from_record({"report_every": 7}, "record").report_every == 7.0


@pytest.mark.parametrize("field, value", [("grace", math.nan), ("grace", -1), ("grace", "10"), ("max_restarts", True),
                                          ("max_restarts", -2), ("on_stall", "explode"), ("stall_after", 0.5),
                                          ("exclude_failed", "yes")])
def test_a_recorded_value_the_option_would_refuse_is_a_usage_error_naming_it(field, value):
    with pytest.raises(UsageError, match=f"attending.{field}: not what --"):
        Attending.from_record({field: value}, "run X's record")
    with pytest.raises(UsageError, match="attending: expected a mapping"):
        Attending.from_record(["grace"], "run X's record")


def test_an_older_record_keeps_its_max_restarts_for_resume():
    """Records written before Attending kept --max-restarts in the plan: --resume still finds it there."""
    from nodectl.inventory import parse_inventory
    from nodectl.plan import build_plan

    inventory = parse_inventory("master_port: 29500\nnodes:\n  - {host: 10.0.0.11, name: node0}\n")
    plan = build_plan(inventory, gpus=1, command=("t.py",), sync_dir="/src", run_id="20260101-000000-abcd")
    old = {"run_id": plan.run_id, "state": "failed", "plan": {**plan.to_json(), "max_restarts": 3}}
    manifest = Manifest.from_json(json.loads(json.dumps(old)))
    assert Attending.from_record(manifest.attending, "record").max_restarts == 3
    fresh = Manifest.from_json(json.loads(json.dumps({**old, "plan": plan.to_json(),
                                                      "attending": Attending(grace=2).to_json()})))
    assert Attending.from_record(fresh.attending, "record") == Attending(grace=2)
