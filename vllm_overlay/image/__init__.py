"""The ROCm image: the pinned base image plus the overlay."""
