"""What each operator costs: time, memory, bytes; the machines it runs on."""
