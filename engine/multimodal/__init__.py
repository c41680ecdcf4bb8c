"""Images in prompts: their validation, the checkpoint's processor on the host, and the
per-image record a request carries into the engine."""
