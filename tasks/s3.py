"""How the control plane opens S3, for model sources (tasks/materialize/sources.py) and the batch
bucket (tasks/batch/files.py) alike: the settings' endpoint and keys (the local stack's moto
server), or, with ``aws_credentials_block``, a prefect-aws ``AwsCredentials`` block (on EKS one
with no keys in it, so boto3 takes the pod's IAM role through its default chain)."""

from __future__ import annotations

from modelops.settings import Settings

__all__ = ["s3_client"]


def s3_client(settings: Settings, config=None) -> tuple[object, str | None]:
    """A boto3 S3 client and the endpoint URL it calls (None: AWS S3 itself).

    Args:
        settings: ``aws_credentials_block``, else ``s3_endpoint`` and the ``aws_*`` keys.
        config: a ``botocore.config.Config`` (timeouts, retries, pool size), or None.

    Raises:
        ValueError: ``aws_credentials_block`` names no AwsCredentials block on the Prefect server
            (the message names the setting and the fix).
    """
    import boto3

    if settings.aws_credentials_block:
        from prefect_aws import AwsCredentials

        try:
            creds = AwsCredentials.load(settings.aws_credentials_block)
        except ValueError as e:
            raise ValueError(f"MODELOPS_AWS_CREDENTIALS_BLOCK: no AwsCredentials block named "
                             f"{settings.aws_credentials_block!r}; create it in Prefect or unset it") from e
        endpoint = creds.aws_client_parameters.endpoint_url
        return creds.get_boto3_session().client("s3", endpoint_url=endpoint, config=config), endpoint
    client = boto3.client("s3", endpoint_url=settings.s3_endpoint, aws_access_key_id=settings.aws_access_key_id,
                          aws_secret_access_key=settings.aws_secret_access_key, region_name=settings.aws_region,
                          config=config)
    return client, settings.s3_endpoint
