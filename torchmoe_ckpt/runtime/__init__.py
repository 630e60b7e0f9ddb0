"""Process and device services the whole library uses, with no library imports: restart-safe process groups,
fault points, exit-time stop of background threads, the hung-collective watchdog, the device-to-host copy stream."""
