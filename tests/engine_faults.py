"""A real built-in engine with one fault: it takes every weight update (a broadcast included, so the
trainer never hangs in it), acknowledges it and relabels its weight version, yet keeps the weights it
has: a push that loads nothing and reports success, which only reading the weights back catches.

    python -m tests.engine_faults <rollout.server arguments>
"""

from __future__ import annotations

import logging
from typing import Optional

from asyncrl.service import serve
from rollout.engine import Engine
from rollout.server import build_app, parse_args

log = logging.getLogger("tests.engine_faults")


class UpdateIgnoringEngine(Engine):
    def update_weights(self, receive, strict, version, flush_cache, abort_all=False):
        def ignore() -> str:
            count = len(receive())
            if version is not None:
                self.scheduler.weight_version = version
            log.info("took %d tensors and kept the old weights; weight_version %s", count, self.weight_version)
            return f"Updated {count} tensors."
        return self.call(ignore)


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args, url_file = parse_args(argv)
    serve(build_app(UpdateIgnoringEngine(args).start()), args.host, args.port, url_file=url_file)


if __name__ == "__main__":
    main()
