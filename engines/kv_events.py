"""vLLM's KV-cache events: subscribing to them, reproducing their block hashes, a sample.

vLLM publishes what its prefix cache stores and evicts when started with
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": "kv-events"}'`. Each ZeroMQ PUB message has three frames:
the topic, an 8-byte big-endian sequence number and a msgpack payload, an `EventBatch` encoded
as an array `[ts, events, data_parallel_rank]`; each event is a map tagged by its `type`
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). docs/real-engines.md has the schema.

`block_hashes()` computes the hashes vLLM publishes (its default `sha256` algorithm), from the
token ids alone: they are reproducible outside the engine.

`python -m engines.kv_events record OUT` starts a replica with a tiny KV cache and events on,
sends requests that store, reuse, salt, evict and clear blocks, and saves the frames received,
as a msgpack array of `[topic, seq, payload]`, the payload bytes exactly as sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

DEFAULT_SEED = "vllm-none-hash"
TOPIC = "kv-events"


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    seed: str = DEFAULT_SEED,
) -> list[int]:
    """The 64-bit block hashes vLLM publishes for a prompt's full blocks.

    vLLM hashes `pickle((parent_digest, tuple(block_token_ids), extra_keys))` with SHA-256;
    the first block's parent is `sha256(pickle(seed))`, where the seed is PYTHONHASHSEED if the
    engine had it set and "vllm-none-hash" otherwise. `extra_keys` is
    `(("cache_salt", salt),)` on the first block of a salted request and None elsewhere (no
    LoRA, no images). Events carry the digest's last 8 bytes as an unsigned integer.
    """
    parent = _sha256(seed)
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 else None
        parent = _sha256((parent, tuple(token_ids[start : start + block_size]), extra))
        hashes.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return hashes


def decode(payload: bytes) -> dict[str, Any]:
    """One message's payload as `{"ts": float, "events": [...], "data_parallel_rank": int}`."""
    import msgpack

    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    return {"ts": ts, "events": events, "data_parallel_rank": rest[0] if rest else None}


def load_sample(path: Path) -> list[tuple[bytes, int, bytes]]:
    """The frames saved by `record`: (topic, sequence number, payload)."""
    import msgpack

    frames = msgpack.unpackb(path.read_bytes(), raw=True)
    return [(bytes(topic), int(seq), bytes(payload)) for topic, seq, payload in frames]


class KVEventSubscriber:
    """A ZeroMQ SUB socket on `endpoint` that collects frames in a thread until closed."""

    def __init__(self, endpoint: str, topic: str = TOPIC) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.frames: list[tuple[bytes, int, bytes]] = []
        self._lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        self._running = True
        ready = threading.Event()
        self._thread = threading.Thread(target=self._receive, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def received(self) -> list[tuple[bytes, int, bytes]]:
        with self._lock:
            return list(self.frames)

    def events(self) -> list[dict[str, Any]]:
        """Every event received so far, in order, each with its batch's sequence number."""
        found: list[dict[str, Any]] = []
        for _, seq, payload in self.received():
            for event in decode(payload)["events"]:
                found.append({**event, "seq": seq})
        return found

    def wait_for(self, predicate: Any, seconds: float = 60.0) -> list[dict[str, Any]]:
        """The events received once `predicate(events)` holds; raises after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            events = self.events()
            if predicate(events):
                return events
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(events)} events, predicate still false")
            time.sleep(0.1)

    def _receive(self, ready: threading.Event) -> None:
        import zmq

        context: zmq.Context[Any] = zmq.Context.instance()
        socket = context.socket(zmq.SUB)
        try:
            socket.connect(self.endpoint)
            socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            ready.set()
            while self._running:
                if socket.poll(100) == 0:
                    continue
                topic, seq, payload = socket.recv_multipart()
                with self._lock:
                    self.frames.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            socket.close(linger=0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def events_config(endpoint: str, topic: str = TOPIC) -> str:
    """The `--kv-events-config` value that publishes on `endpoint` (bound when it has `*`)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    return json.dumps(config)


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer: dict[str, Any] = json.loads(reply.read() or b"{}")
        return answer


def record(out: Path) -> int:
    """Start a small replica, provoke every kind of event, save the frames to `out`."""
    import msgpack

    from engines.fleet import MODEL_NAME, model_folder
    from engines.replica import MIB, VLLMReplica
    from engines.tiny_model import ensure_model
    from engines.venv import VLLMVenv

    venv = VLLMVenv().ensure()
    model = ensure_model(venv.python, model_folder())
    with tempfile.TemporaryDirectory() as folder:
        endpoint = f"ipc://{folder}/kv-events.sock"
        replica = VLLMReplica(
            model,
            venv=venv,
            served_model_names=(MODEL_NAME,),
            kv_cache_bytes=MIB,  # 512 tokens: 16 blocks of 32, so a few prompts evict
            max_model_len=480,  # one of the 16 blocks is vLLM's null block
            extra_args=("--kv-events-config", events_config(endpoint)),
            env={"VLLM_SERVER_DEV_MODE": "1"},  # for POST /reset_prefix_cache
        )
        with replica, KVEventSubscriber(endpoint) as subscriber:
            time.sleep(1)  # a SUB socket misses what is published before it is connected

            def chat(content: str, **extra: Any) -> None:
                messages = [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": content},
                ]
                body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2}
                _post(replica.url + "/v1/chat/completions", {**body, "ignore_eos": True, **extra})

            question = "the river runs past the old mill and on to the sea " * 3
            chat(question)  # BlockStored, parent None
            chat(question + "and then what?")  # BlockStored for the new tail only
            chat(question, vllm_xargs={"kv_cache_report_mode": "full"})  # reused, reported
            chat(question, cache_salt="tenant-a")  # salted: new hashes, extra_keys
            for turn in range(4):  # 16 blocks fill up: BlockRemoved
                chat(f"question {turn}: " + "what is the weather like today " * 8)
            _post(replica.url + "/reset_prefix_cache")  # AllBlocksCleared...
            chat("hi")  # ...published with the next scheduler step's batch
            subscriber.wait_for(
                lambda events: any(e["type"] == "AllBlocksCleared" for e in events), 30
            )
            frames = subscriber.received()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgpack.packb([list(frame) for frame in frames], use_bin_type=True))
    kinds: dict[str, int] = {}
    for _, _, payload in frames:
        for event in decode(payload)["events"]:
            kinds[event["type"]] = kinds.get(event["type"], 0) + 1
    print(f"{len(frames)} messages, {out.stat().st_size} bytes: {kinds}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM KV-cache events")
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="record a sample of real events")
    recording.add_argument("out", type=Path)
    options = parser.parse_args(argv)
    return record(options.out)


if __name__ == "__main__":
    raise SystemExit(main())
