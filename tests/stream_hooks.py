"""What a test runs in a spawned generation worker in place of rlkit.async_rollout._serve (Rollouts.serve): the same
serve loop, with the Generator slowed or hung from outside -- the library has no test knob.

    monkeypatch.setattr(Rollouts, "serve", staticmethod(functools.partial(slowed, workers=(1,), generate_s=3.0)))

A partial of this module's function pickles by name: the spawned child imports this module (tests/ is on the sys.path
it inherits) and patches its own Generator before serving."""

import time

from rlkit import async_rollout


def slowed(args, jobs, results, updates=None, stop=None, *, workers=(0,), generate_s=0.0, poll_s=0.0, hang=False):
    """_serve, with Generator.generate sleeping generate_s before each job (hang: forever) and on_new_weights sleeping
    poll_s at each in-flight poll, in the workers numbered in `workers` (args[-1] is the worker's number)."""
    if args[-1] in workers:
        gen, poll = async_rollout.Generator.generate, async_rollout.Generator.on_new_weights

        def generate(self, *a, **kw):
            while hang:
                time.sleep(1.0)
            time.sleep(generate_s)
            return gen(self, *a, **kw)

        def on_new_weights(self):
            time.sleep(poll_s)
            return poll(self)

        async_rollout.Generator.generate, async_rollout.Generator.on_new_weights = generate, on_new_weights
    async_rollout._serve(args, jobs, results, updates, stop)
