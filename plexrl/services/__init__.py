"""Services: long-lived LLM execution endpoints hosting the engines of the jobs placed on them."""

from plexrl.services.service import Service

__all__ = ["Service"]
