"""The service: lifecycle (``app``), systemd notify and watchdog, metrics, the
admin listener, logging, the shutdown deadline and the trigger wiring."""
