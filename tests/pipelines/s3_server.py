"""An S3-compatible HTTP server for the tests: moto's server, with two of S3's behaviours
that moto lacks.

- Authentication: moto answers requests whatever their credentials (an unsigned request is
  served as if it were signed), so a job without credentials would pass against it where S3
  refuses it. Like S3, this server refuses a request that carries no signature
  (`AccessDenied`) or whose access key it does not know (`InvalidAccessKeyId`), with S3's
  XML error body; signed requests of the known key go to moto.
- moto names the body of a completed multipart upload `CompleteMultipartUploadResponse`;
  S3 sends `CompleteMultipartUploadResult`, and the AWS SDK inside pyarrow reads only that
  one (it takes the unnamed body for an error and retries until it fails).

Run: `python -m tests.pipelines.s3_server ACCESS_KEY`; it prints `port <n>` once it listens
on 127.0.0.1 and serves until killed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _s3_error(start_response: Callable[..., Any], code: str, message: str) -> list[bytes]:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        "<RequestId>batchlm-test</RequestId></Error>"
    ).encode()
    start_response(
        "403 Forbidden",
        [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
    )
    return [body]


def require_signature(app: WSGIApp, access_key: str) -> WSGIApp:
    """`app` behind S3's check of who signed the request."""

    def checked(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        auth = environ.get("HTTP_AUTHORIZATION", "")
        query = environ.get("QUERY_STRING", "")
        found = _CREDENTIAL.search(auth) or re.search(r"X-Amz-Credential=([^%/&]+)", query)
        if found is None:
            return _s3_error(start_response, "AccessDenied", "Access Denied")
        if found.group(1) != access_key:
            return _s3_error(
                start_response,
                "InvalidAccessKeyId",
                "The AWS Access Key Id you provided does not exist in our records.",
            )
        if environ.get("REQUEST_METHOD") == "POST" and "uploadId=" in query:
            return _renamed_completion(app, environ, start_response)
        return app(environ, start_response)

    return checked


def _renamed_completion(
    app: WSGIApp, environ: dict[str, Any], start_response: Callable[..., Any]
) -> Iterable[bytes]:
    """moto's answer to CompleteMultipartUpload with the root element S3 uses."""
    captured: list[Any] = []

    def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        captured[:] = [status, headers, exc_info]
        return lambda data: None

    body = b"".join(app(environ, keep))
    body = body.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult")
    status, headers, exc_info = captured
    headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
    start_response(status, [*headers, ("Content-Length", str(len(body)))], exc_info)
    return [body]


def main() -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class QuietHandler(WSGIRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass

    app = require_signature(DomainDispatcherApplication(create_backend_app), sys.argv[1])
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietHandler)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
