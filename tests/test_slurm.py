"""Slurm's formats read without Slurm (voxdiff.slurm): memory sizes, time limits, a running job's memory."""

from __future__ import annotations

import pytest

from voxdiff.slurm import parse_slurm_memory, parse_slurm_time, read_site_env, slurm_job_memory


@pytest.mark.parametrize("text, nbytes", [("64G", 64 * 2**30), ("128000", 128000 * 2**20), ("512M", 512 * 2**20),
                                          ("1.5T", int(1.5 * 2**40)), ("2048K", 2 * 2**20)])
def test_slurm_memory_sizes(text, nbytes):
    assert parse_slurm_memory(text) == nbytes


def test_slurm_memory_refuses_a_non_size():
    with pytest.raises(ValueError, match="64GiB"):
        parse_slurm_memory("64GiB")


def test_the_memory_of_a_running_slurm_job():
    assert slurm_job_memory({"SLURM_MEM_PER_NODE": "1000"}) == 1000 * 2**20
    assert slurm_job_memory({"SLURM_MEM_PER_GPU": "1000", "SLURM_GPUS_ON_NODE": "4"}) == 4000 * 2**20
    assert slurm_job_memory({"SLURM_MEM_PER_CPU": "10", "SLURM_CPUS_ON_NODE": "8"}) == 80 * 2**20
    assert slurm_job_memory({}) is None and slurm_job_memory({"SLURM_MEM_PER_NODE": "0"}) is None  # the whole node


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("10:30", 630), ("48:00:00", 172800),
                                           ("2-00:00:00", 172800), ("1-12", 129600), ("1-00:30", 88200)])
def test_slurm_time_limits(text, seconds):
    assert parse_slurm_time(text) == seconds


def test_slurm_time_refuses_unlimited():
    with pytest.raises(ValueError, match="UNLIMITED"):
        parse_slurm_time("UNLIMITED")


def test_site_env_lines(tmp_path):
    site = tmp_path / "site.env"
    site.write_text("# a comment\n\nPARTITION=gpu\nTIME = 2-00:00:00\nEMPTY=\n")
    assert read_site_env(site) == {"PARTITION": "gpu", "TIME": "2-00:00:00", "EMPTY": ""}
    site.write_text("PARTITION gpu\n")
    with pytest.raises(ValueError, match="site.env:1: expected KEY=VALUE"):
        read_site_env(site)
