"""The simulated execution backend: a benchmark instrument, never a model.

It stands in for a named GPU running a named ERNIE-4.5 shape so that everything on the host (scheduler, KV
accounting, the host side of sampling, output processing, the Triton stubs, tritonserver, the shim) can be measured
at the pace that GPU would set. A step sleeps for the modeled step time (time.sleep releases the GIL and burns no
CPU) and returns token ids replayed from fixed text, so its outputs carry no information about any prompt.

- targets.py: the GPUs and model shapes it knows, and the model's constants (SimulationConstants).
- step_model.py: the roofline step time and the target's KV pool size.
- replay.py: the replayed text and which ids a row gets (its request and position only).
- logits.py: the replayed ids as DeviceLogits, so the engine's sampler runs its usual bookkeeping.
- executor.py: the StepExecutor; loading.py builds it; support.py says what it refuses.

Chosen only by execution_backend='simulated' (never by 'auto'); docs/serving-path.md describes it.
"""
