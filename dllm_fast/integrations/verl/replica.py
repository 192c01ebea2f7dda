"""The servers verl's agent loop talks to for `rollout.name=dllm_fast`: one `DllmFastReplica` per hybrid worker
(registered in verl's `RolloutReplicaRegistry`), each with one `DllmFastServer` Ray actor on the worker's node.

verl's agent loop sends one request per sample (`server.generate(request_id, prompt_ids, sampling_params)`)
through its load balancer, all of a batch at once. A diffusion rollout decodes a batch in the time of one sample,
so the server collects the requests that arrive together (until none has come for `batch_wait_s`, or
`max_batch_size` are waiting), groups them by temperature, and runs each group as one `dllm_fast.generate` call in
the worker process (`rollout.decode_on_worker` through Ray's `__ray_call__`), where the rollout decodes with the
actor's weights (rollout.py). The server holds no model; it is a queue in front of the worker.

Only the hybrid mode runs here (the rollout shares the actor's worker and weights): colocated and standalone
rollouts (separate rollout processes, e.g. the one-step-off or fully async trainers) are refused by name.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import ray

from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from dllm_fast.integrations.verl.rollout import (ROLLOUT_NAME, check_sampling_params, decode_on_worker,
                                                 release_on_worker, rollout_settings)

logger = logging.getLogger(__name__)


class DllmFastServer:
    """A replica's request queue (module docstring); made a Ray actor by `DllmFastReplica`."""

    def __init__(self, workers, max_batch_size: int, batch_wait_s: float, replica_rank: int):
        if len(workers) != 1:
            raise ValueError(f"a dllm_fast rollout replica decodes on one worker, got {len(workers)}; set "
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=1.")
        self.worker = workers[0]
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.replica_rank = replica_rank
        self.pending: list[tuple[list[int], float, asyncio.Future]] = []
        self.arrived = None  # set on every arrival: the collector's "not quiet yet"
        self.collector: asyncio.Task | None = None

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, image_data=None,
                       video_data=None, audio_data=None, **unused) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("the dllm_fast rollout decodes text only; the request carries image, video or audio "
                             "data.")
        temperature = check_sampling_params(dict(sampling_params))
        if not prompt_ids:
            raise ValueError(f"request {request_id} has an empty prompt; every prompt needs at least one token.")
        future = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), temperature, future))
        if self.arrived is None:
            self.arrived = asyncio.Event()
        self.arrived.set()
        if self.collector is None or self.collector.done():
            self.collector = asyncio.create_task(self._collect())
        return await future

    async def _collect(self) -> None:
        """Wait until the arrivals go quiet (or a batch is full), then decode everything pending."""
        while self.pending:
            while len(self.pending) < self.max_batch_size:
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), timeout=self.batch_wait_s)
                except asyncio.TimeoutError:
                    break
            batch, self.pending = self.pending[:self.max_batch_size], self.pending[self.max_batch_size:]
            groups = defaultdict(list)
            for prompt, temperature, future in batch:
                groups[temperature].append((prompt, future))
            for temperature, requests in groups.items():
                try:
                    outputs = await self.worker.__ray_call__.remote(decode_on_worker, [p for p, _ in requests],
                                                                    temperature)
                except Exception as error:  # the agent loop sees the worker's error on every request of the batch
                    for _, future in requests:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), output in zip(requests, outputs):
                    token_ids = output.pop("token_ids")
                    if not future.done():
                        future.set_result(TokenOutput(token_ids=token_ids, stop_reason="completed",
                                                      extra_fields=output))

    async def sleep(self) -> None:
        await self.worker.__ray_call__.remote(release_on_worker)

    async def wake_up(self) -> None:
        """The weights come back with the next update_weights (verl's naive sync)."""

    # The KV caches of a diffusion rollout live within one generate call: nothing to free, clear or abort between.
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def wait_for_requests_to_drain(self) -> None:
        while self.pending or (self.collector is not None and not self.collector.done()):
            await asyncio.sleep(self.batch_wait_s or 0.01)

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        await self.wait_for_requests_to_drain()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None: ...
    async def start_profile(self, **kwargs) -> None: ...
    async def stop_profile(self) -> None: ...


class DllmFastReplica(RolloutReplica):
    """One hybrid worker's rollout server (module docstring)."""

    async def launch_servers(self):
        if self.rollout_mode != RolloutMode.HYBRID:
            raise ValueError(f"the dllm_fast rollout runs in verl's hybrid mode only (inside the actor's workers), "
                             f"not {self.rollout_mode.value}; use trainer.use_v1 with trainer_mode=sync or the "
                             "legacy trainer, with actor_rollout_ref.hybrid_engine=True.")
        settings = rollout_settings(self.config)
        node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
        server_class = ray.remote(DllmFastServer)
        server = server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id,
                                                                                              soft=False),
            name=f"dllm_fast_server_{self.replica_rank}{self.name_suffix}_{id(self):x}",
            max_concurrency=self.max_concurrency, num_cpus=0,
        ).remote(self.workers, settings.max_batch_size, settings.batch_wait_s, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"dllm_fast-replica-{self.replica_rank}{self.name_suffix}"

    async def init_colocated(self, resource_pool):
        raise ValueError("the dllm_fast rollout shares the actor's workers (hybrid mode); a colocated rollout in "
                         "separate processes is not supported.")

    async def init_standalone(self):
        raise ValueError("the dllm_fast rollout shares the actor's workers (hybrid mode); a standalone rollout "
                         "(rollout.nnodes > 0, one-step-off or fully async training) is not supported.")

