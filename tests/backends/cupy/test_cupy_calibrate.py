"""A GPU calibration file (measured on the device) becomes a DeviceSpec here; bad files are refused by name."""

import json

import pytest

from backends.cupy.calibrate import SCHEMA, spec_from_measured
from planner.cli import main
from planner.core.cost import DeviceSpecError, load_device

H200 = load_device("h200")


def measured(**over):
    data = {
        "schema": SCHEMA,
        "device": "NVIDIA H200",
        "sm_count": 132,
        "date": "2026-12-01T00:00:00+00:00",
        "launch_us": 2.4,
        "host_launch_us": 5.1,
        "copy_gbps": {"64": 3100.0, "512": 4010.5, "2048": 4120.0},
        "gemm_tflops": {"fp16": {"2048": 510.0, "4096": 690.0, "8192": 742.0}, "fp32": {"2048": 48.0}},
    }
    data.update(over)
    return data


def test_measured_figures_replace_the_assumed_ones_and_the_peaks_stay():
    spec = spec_from_measured(measured(), H200, "cal.json")
    assert spec.name == "h200-measured"
    assert spec.bandwidth_gbps == 4120.0 and spec.launch_us == 2.4 and spec.sm_count == 132
    assert spec.gemm_efficiency["cublaslt"] == round(742.0 / 989.0, 3)
    assert spec.gemm_efficiency["custom"] == H200.gemm_efficiency["custom"]  # nothing times the custom kernels
    assert spec.matmul_tflops == H200.matmul_tflops and spec.regs_per_sm == H200.regs_per_sm
    assert "measured on NVIDIA H200" in spec.source and "cal.json" in spec.source


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"schema": "other"}, "not a GPU calibration"),
        (measured(launch_us=-1), "'launch_us' must be a positive number"),
        (measured(copy_gbps={}), "'copy_gbps' must be a non-empty object"),
        (measured(copy_gbps={"64": "fast"}), "must be a positive number"),
        (measured(gemm_tflops={"fp32": {"2048": 40.0}}), "'fp16' table"),
        (measured(gemm_tflops={"fp16": {"8192": 2500.0}}), "exceeds the h200 peak"),
        ([], "not a GPU calibration"),
    ],
)
def test_a_malformed_calibration_is_refused_naming_the_field(data, match):
    with pytest.raises(DeviceSpecError, match=match):
        spec_from_measured(data, H200, "cal.json")


def test_cli_turns_the_file_into_a_spec_the_planner_loads(tmp_path, capsys):
    cal, out = tmp_path / "cal.json", tmp_path / "spec.json"
    cal.write_text(json.dumps(measured()))
    assert main(["calibrate", "--from-measured", str(cal), "--base", "h200", "-o", str(out)]) == 0
    spec = load_device(str(out))
    assert spec.bandwidth_gbps == 4120.0 and spec.name == "h200-measured"
    assert main(["explain", "--example", "mlp-epilogue", "--m", "256", "--n", "256", "--k", "256",
                 "--device", str(out)]) == 0
    cal.write_text("{not json")
    assert main(["calibrate", "--from-measured", str(cal)]) == 2
    assert "calibration file" in capsys.readouterr().err
