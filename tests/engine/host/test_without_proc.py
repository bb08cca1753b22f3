"""A machine where psutil cannot read the mount table, the processes or the memory (/proc
hidden under a tmpfs, in a user and mount namespace of a subprocess): the engine still runs.
The SSD tier is refused unless the user names "unknown"; named, it works with peers judged by
heartbeats only (no boot id, no PID namespace, no start times); the memory pressure guard
reads nothing and reclaims nothing, so the RAM tier takes a fixed budget instead of adapting
(default_ram_budget: 4 GiB where physical memory is unknown)."""

from __future__ import annotations

from namespaces import in_namespace, needs_namespaces


@needs_namespaces
def test_the_engine_runs_without_proc(tiny_model_dir, tmp_path):
    got = in_namespace(["mount -t tmpfs none /proc"], f"""
        import json, warnings
        from mlxcache_kernel.engine import Engine, SamplingParams
        from mlxcache_kernel.engine.cache.catalog.liveness import Identity
        from mlxcache_kernel.engine.host.system import physical_memory

        prompt, params = [5, 6, 7, 8, 9] * 10, SamplingParams(max_tokens=4)
        me = Identity.current()
        out = {{"identity": [me.start, me.boot, me.pidns, me.same_pids({{"boot": me.boot, "pidns": me.pidns}})],
               "physical": physical_memory()}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng = Engine(cache_dir={str(tmp_path / "ram")!r})
        eng.load_model({str(tiny_model_dir)!r}, name="m")
        first = eng.generate_tokens(prompt, params=params)
        again = eng.generate_tokens(prompt, params=params)
        s = eng.stats()
        out["ram"] = [any("RAM-only" in str(w.message) for w in caught), s["ssd_disabled_reason"],
                      again.stats["cache_source"], again.tokens == first.tokens, s["pressure_checks"],
                      s["memory_working_bytes"], s["ram_budget_bytes"]]
        eng.close()
        for step in ("write", "read"):
            with Engine(cache_dir={str(tmp_path / "ssd")!r}, ssd_filesystems="unknown") as eng:
                eng.load_model({str(tiny_model_dir)!r}, name="m")
                r = eng.generate_tokens(prompt, params=params)
                eng.flush()
                out[step] = [eng.stats()["ssd_disabled_reason"], r.stats["cache_source"], r.tokens == first.tokens]
        print(json.dumps(out))
    """)
    assert got["identity"] == [None, "", "", False] and got["physical"] is None
    warned, reason, source, same, checks, working, budget = got["ram"]
    assert warned and reason.startswith("cache directory") and "unknown (its type could not be read)" in reason
    assert source == "ram" and same and checks == 0 and working is None and budget == 4 << 30
    assert got["write"][0] is None and got["read"] == [None, "ssd", True]
