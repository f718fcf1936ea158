"""Third-party emulators of the outside services (not written here), run for tests."""
