from nodectl.envdump import diff_reports, flatten


def test_flatten_keys_nics_by_name():
    flat = flatten({"torch": {"version": "2.6"}, "nics": [{"name": "eth0", "mtu": 1500}], "gpus": {"devices": [1, 2]}})
    assert flat == {"torch.version": "2.6", "nics.eth0.mtu": 1500, "gpus.devices.0": 1, "gpus.devices.1": 2}


def test_diff_shows_only_drift_not_volatile_facts():
    a = {"torch": {"version": "2.6.0", "nccl": "2.21.5"}, "clock": {"time": 1.0}, "packages": {"peft": "0.12"},
         "env": {"PWD": "/a"}}
    b = {"torch": {"version": "2.6.0", "nccl": "2.20.3"}, "clock": {"time": 2.0}, "packages": {},
         "env": {"PWD": "/b"}}
    diff = diff_reports({"n0": a, "n1": a, "n2": b})
    assert diff == {"torch.nccl": {"n0": "2.21.5", "n1": "2.21.5", "n2": "2.20.3"},
                    "packages.peft": {"n0": "0.12", "n1": "0.12", "n2": "<missing>"}}


def test_the_versions_a_run_depends_on_come_before_the_long_tail_of_packages():
    def node(torch, extra):
        return {"torch": {"version": torch}, "packages": {f"pkg{i:03d}": extra for i in range(50)},
                "env": {"FOO": extra}, "python": {"version": "3.11.9"}, "os": {"kernel": extra}}

    keys = list(diff_reports({"a": node("2.6.0", "1"), "b": node("2.5.1", "2")}))
    assert keys[0] == "torch.version" and keys[1] == "os.kernel"
    assert all(k.startswith(("packages.", "env.")) for k in keys[2:])
