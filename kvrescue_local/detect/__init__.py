"""Online degeneration detector for candidate steps: windowed token entropy and text compressibility."""

from .calibrate import calibrate, otsu_threshold
from .detector import Detector, DetectorParams, Monitor, compression_ratio, token_entropy

__all__ = ["Detector", "DetectorParams", "Monitor", "calibrate", "compression_ratio", "otsu_threshold", "token_entropy"]
