"""Log formats of the CLI: text, or one JSON object per line with the record's extra fields (request_id, ...)."""
from __future__ import annotations

import json
import logging

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "msg", + the extras passed to the log call, e.g. request_id, status, tokens}."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# Every character that ends a line somewhere (C0 controls, NEL U+0085, U+2028, U+2029: str.splitlines() and many
# log viewers break on them), every other C1 control (U+009B is a terminal's CSI) and the bidi controls that
# reorder what a terminal shows, as escapes.
_BIDI = (*range(0x200E, 0x2010), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_CONTROL = ({c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
            | {c: f"\\u{c:04x}" for c in (0x2028, 0x2029, *_BIDI)} | {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"})


def escape(text: str) -> str:
    """Control characters and line separators as escapes: text from a client (a request id) can never start a log
    line of its own, nor steer the terminal that shows it."""
    return text.translate(_CONTROL)


class TextFormatter(logging.Formatter):
    """The plain format, with the message's control characters escaped (tracebacks stay multi-line)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


def configure(fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        formatter = JsonFormatter()
        formatter.converter = __import__("time").gmtime
        handler.setFormatter(formatter)
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
