"""How S3 faults are judged: which are worth retrying, and what a user is told.

s3fs turns a botocore ``ClientError`` into a Python ``OSError`` and chains the
original as ``__cause__``; the S3 error code (``NoSuchBucket``, ``SlowDown``…)
is only on that original. This module reads the code back from the chain and
decides two things: whether a fault is worth retrying (throttling, 5xx,
dropped connections) and which message a user gets for the ones that are not
(a missing bucket, denied access, rejected credentials). Messages name the
bucket and URL and never a key or secret.

Nothing here imports botocore: the ``s3`` extra is optional, so codes are read
from the exception's ``response`` dict, and botocore's own errors are known by
class name. The rules that hold for every store (errno values, aiohttp's
dropped connections) are :class:`~elastictrain.storage.generic.Backend`'s.
"""

from __future__ import annotations

from typing import Any

from elastictrain.core.errors import StorageError, StorageNotFoundError, StoragePermissionError
from elastictrain.storage.generic import cause_chain

THROTTLING_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestLimitExceeded", "RequestThrottled", "TooManyRequestsException",
    "TooManyRequests", "BandwidthLimitExceeded",
})
TRANSIENT_CODES = THROTTLING_CODES | frozenset({
    "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeoutException",
    "PriorRequestNotComplete", "OperationAborted",
})
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
MISSING_BUCKET_CODES = frozenset({"NoSuchBucket"})
CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AuthFailure",
})
# botocore raises these before any request when the chain finds nothing usable.
NO_CREDENTIAL_CODES = frozenset({"NoCredentialsError", "PartialCredentialsError",
                                 "NoAuthTokenError"})
DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem",
                          "InvalidPayer", "NotSignedUp"})
# Stores that do not implement conditional writes answer If-None-Match with one of these.
CONDITIONAL_UNSUPPORTED_CODES = frozenset({"NotImplemented", "501"})

# botocore's connection-level failures, by class name (no imports).
BOTOCORE_CONNECTION_ERRORS = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError",
    "ReadTimeoutError", "ProxyConnectionError", "ResponseStreamingError",
    "IncompleteReadError", "HTTPClientError",
})


def error_code(exc: BaseException) -> str | None:
    """The S3 error code (``NoSuchBucket``, ``SlowDown``…) behind ``exc``, if any.

    botocore's credential errors carry no response; their class name is the code.
    """
    for link in cause_chain(exc):
        response: Any = getattr(link, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
        if type(link).__name__ in NO_CREDENTIAL_CODES | {"ProfileNotFound"}:
            return type(link).__name__
    return None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of the S3 response behind ``exc``, if any."""
    for link in cause_chain(exc):
        response: Any = getattr(link, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def is_transient(exc: BaseException) -> bool | None:
    """True for throttling, 5xx and botocore's dropped connections; False for other S3
    errors; None when ``exc`` is not an S3/botocore error (the generic rules decide)."""
    code = error_code(exc)
    status = http_status(exc)
    if code is not None or status is not None:
        return code in TRANSIENT_CODES or status in TRANSIENT_STATUSES
    if any(type(link).__name__ in BOTOCORE_CONNECTION_ERRORS for link in cause_chain(exc)):
        return True
    return None


def is_missing_bucket(exc: BaseException) -> bool:
    return error_code(exc) in MISSING_BUCKET_CODES


def is_conditional_unsupported(exc: BaseException) -> bool:
    """The store rejected ``If-None-Match`` (an S3-compatible store without it)."""
    return error_code(exc) in CONDITIONAL_UNSUPPORTED_CODES or http_status(exc) == 501


def translate(op: str, where: str, bucket: str, exc: BaseException) -> StorageError | None:
    """A clear, secret-free error for the non-retryable S3 faults users can fix;
    None for anything else (the caller's generic translation applies)."""
    code = error_code(exc)
    if code in MISSING_BUCKET_CODES:
        return StorageNotFoundError(
            f"{op} {where}: bucket {bucket!r} does not exist ({code}); fix: create the "
            f"bucket (e.g. `aws s3 mb s3://{bucket}`, with --endpoint-url for MinIO or "
            "another S3-compatible store) or correct the storage URL"
        )
    if code in NO_CREDENTIAL_CODES:
        return StoragePermissionError(
            f"{op} {where}: no usable S3 credentials were found ({code}); fix: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, storage_options "
            'key/secret, or run with an instance role; for a public bucket pass {"anon": true}'
        )
    if code == "ProfileNotFound":
        return StoragePermissionError(
            f"{op} {where}: the AWS profile to use does not exist (ProfileNotFound); fix: "
            "correct AWS_PROFILE or storage_options profile, or define it in ~/.aws/config"
        )
    if code in CREDENTIAL_CODES:
        return StoragePermissionError(
            f"{op} {where}: the S3 endpoint rejected the credentials ({code}); fix: check "
            "the access key and secret elastictrain found (storage_options key/secret, "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the instance role) "
            "and that they belong to this endpoint"
        )
    if code in DENIED_CODES:
        return StoragePermissionError(
            f"{op} {where}: access denied ({code}); fix: allow s3:ListBucket on bucket "
            f"{bucket!r} and s3:GetObject, s3:PutObject, s3:DeleteObject, "
            "s3:AbortMultipartUpload on the run's prefix for the identity in use"
        )
    return None
