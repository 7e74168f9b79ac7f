"""vLLM's own load client (``vllm bench serve``), able to send a body field per request from a dataset file.

Run exactly as the ``vllm`` command: ``python -m kvtier.bench.vllm_client bench serve --dataset-name
custom --dataset-path FILE ...``. vLLM's client merges a request's ``request_overrides`` into its body
(its tool-call datasets use that), but its ``custom`` JSONL dataset reads only ``prompt`` and
``output_tokens``. Here a line's ``request_overrides`` (a JSON object) is kept too, so that a
benchmark can say per request what a real client would: ``kvtier bench serve --workload longtail``
sends each returning user's requests with the retention hint (``{"kv_transfer_params": {"kvtier":
{"retain": PREFIX_LEN}}}``, docs/vllm.md). Everything else is vLLM's client, unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

OVERRIDES_FIELD = "request_overrides"


def install() -> None:
    """Makes vLLM's ``custom`` dataset carry each line's ``request_overrides`` to its request."""
    from vllm.benchmarks.datasets import datasets

    custom = datasets.CustomDataset
    if getattr(custom.sample, "kvtier_overrides", False):
        return
    original = custom.sample

    def sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        requests = original(self, *args, **kwargs)
        # sample() walks self.data in order and makes request i of line i (--disable-shuffle keeps
        # the file's order); oversampled copies past the file's end keep none.
        for request, item in zip(requests, self.data, strict=False):
            overrides = item.get(OVERRIDES_FIELD)
            if isinstance(overrides, dict):
                request.request_overrides = overrides
        return requests

    sample.kvtier_overrides = True  # type: ignore[attr-defined]
    custom.sample = sample  # type: ignore[method-assign]


def main() -> int:
    install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
