"""How a batch ends: the lines of its output and error files, the files themselves, and
its final status (completed, cancelled, expired, failed)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import structlog

from gateway.batch.files import FileStore
from gateway.batch.input import BatchLine
from gateway.batch.records import BatchStore, batch_owner

log = structlog.get_logger("fairgate.batch")


def output_line(custom_id: str, status: int | None, body: Any,
                error: dict[str, Any] | None) -> dict[str, Any]:
    """One line of OpenAI's batch output/error file."""
    response = None if status is None else {
        "status_code": status, "request_id": uuid.uuid4().hex, "body": body}
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": response, "error": error}


class BatchResults:
    def __init__(self, files: FileStore, batches: BatchStore) -> None:
        self.files = files
        self.batches = batches

    async def finish(self, batch_id: str, doc: dict[str, Any], lines: list[BatchLine],
                     outcome: str) -> None:
        """End a run batch by its ``outcome`` ("completed", "cancelled", "revoked" or
        "expired"): an expired batch's unfinished lines become errors, the results go to
        its output and error files, and it takes its final status."""
        if outcome == "completed":
            await self.batches.transition(batch_id, ("in_progress",), "finalizing",
                                          "finalizing_at")
        if outcome == "expired":  # unfinished lines become errors (and count as failed)
            done = await self.batches.done_ids(batch_id)
            for line in lines:
                if line.custom_id not in done:
                    await self.batches.record(batch_id, line.custom_id, output_line(
                        line.custom_id, None, None,
                        {"code": "batch_expired",
                         "message": "This request could not be executed before the "
                                    "completion window expired."}), ok=False)
        ok = await self.batches.results(batch_id, ok=True)
        failed = await self.batches.results(batch_id, ok=False)
        fields: dict[str, str | int] = {}
        for name, results, suffix in (("output_file_id", ok, "output"),
                                      ("error_file_id", failed, "error")):
            if results:
                data = "".join(results[line.custom_id] + "\n" for line in lines
                               if line.custom_id in results).encode()
                meta = await self.files.create(batch_owner(doc), f"{batch_id}_{suffix}.jsonl",
                                               "batch_output", data)
                fields[name] = meta.id
        if outcome == "revoked":
            fields["errors"] = json.dumps({"object": "list", "data": [{
                "code": "api_key_revoked", "param": None, "line": None,
                "message": "the API key that created this batch was revoked: the batch was "
                           "cancelled, the lines that had finished are in its files"}]})
        if fields:
            await self.batches.set_fields(batch_id, **fields)
        final = {"completed": ("completed", "completed_at", ("finalizing",)),
                 "cancelled": ("cancelled", "cancelled_at", ("cancelling", "in_progress")),
                 "revoked": ("cancelled", "cancelled_at",
                             ("cancelling", "in_progress", "validating")),
                 "expired": ("expired", "expired_at", ("in_progress", "validating"))}[outcome]
        if (not await self.batches.transition(batch_id, final[2], final[0], final[1])
                and outcome == "completed"
                and await self.batches.transition(batch_id, ("cancelling",), "cancelled",
                                                  "cancelled_at")):
            # a cancel came after its last line's result, while it finalized: every line
            # has its result, the cancel is honoured (left "cancelling", it never ended)
            final = ("cancelled", "cancelled_at", ("cancelling",))
        await self.batches.retire(batch_id)
        log.info("batch_finished", batch_id=batch_id, status=final[0], completed=len(ok),
                 failed=len(failed))

    async def fail(self, batch_id: str, message: str) -> None:
        """The batch's input file could not be read: it ends failed, with why."""
        errors = {"object": "list", "data": [{"code": "invalid_input", "message": message,
                                              "param": None, "line": None}]}
        await self.batches.set_fields(batch_id, errors=json.dumps(errors))
        await self.batches.transition(batch_id, ("validating", "in_progress"), "failed",
                                      "failed_at")
        await self.batches.retire(batch_id)
