"""Fault injection, for tests: make a stage of the engine's step raise (or hang) at chosen steps.

A spec names stages and steps, comma-separated: "forward@3,sampler@5,detokenize@7" raises in the model
forward at the engine's 3rd step that runs a batch, in the sampler at the 5th and in the detokenizer
at the 7th; "forward@10+" raises from the 10th step on, as a sticky device error would; "hang@3" never
returns from the model forward of the 3rd step, as a hung GPU would not. The tritonserver model reads a
spec from the INFLIGHT_FAULTS environment variable; nothing is injected without one.
"""

import functools
import threading

STAGES = {"forward": "_forward", "sampler": "_sample", "detokenize": "_detokenize"}  # (they raise)
HANG = "hang"  # (the model forward never returns)


class InjectedFault(RuntimeError):
    pass


def parse(spec: str) -> dict[str, tuple[set[int], int | None]]:
    """{stage: (steps, first step of a persistent fault or None)}; raises ValueError on a bad spec."""
    plan: dict[str, tuple[set[int], int | None]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        stage, _, when = item.partition("@")
        persistent = when.endswith("+")
        when = when.rstrip("+")
        if (stage not in STAGES and stage != HANG) or not when.isdigit():
            raise ValueError(f"bad fault {item!r}: expected STAGE@STEP or STAGE@STEP+, STAGE one of "
                             f"{', '.join([*STAGES, HANG])}")
        steps, start = plan.get(stage, (set(), None))
        if persistent:
            start = int(when) if start is None else min(start, int(when))
        else:
            steps.add(int(when))
        plan[stage] = (steps, start)
    return plan


def inject(engine, spec: str | None):
    """Wrap the engine's stages as `spec` says; returns the engine (unchanged for an empty spec)."""
    for stage, (steps, start) in parse(spec or "").items():
        name = STAGES["forward" if stage == HANG else stage]  # (a hang is the model forward's)
        original = getattr(engine, name)

        @functools.wraps(original)
        def faulty(*args, _original=original, _stage=stage, _steps=steps, _start=start, **kwargs):
            step = engine.num_steps
            if step in _steps or (_start is not None and step >= _start):
                if _stage == HANG:
                    threading.Event().wait()  # (forever: only a kill ends it)
                raise InjectedFault(f"injected {_stage} fault at step {step}")
            return _original(*args, **kwargs)

        setattr(engine, name, faulty)
    return engine
