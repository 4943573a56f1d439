"""The mesh helpers build named meshes with row-major rank layouts, or explain why not."""

import pytest

from reffsdp.testing.meshes import mesh_1d, mesh_dp_tp, mesh_hsdp, mesh_nd
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread


class TestMeshes(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 8

    def test_mesh_1d(self):
        mesh = mesh_1d("cpu")
        self.assertEqual(mesh.mesh_dim_names, ("dp_shard",))
        self.assertEqual(mesh.mesh.tolist(), list(range(8)))
        self.assertEqual(mesh.get_local_rank("dp_shard"), self.rank)

    def test_mesh_hsdp_2x4(self):
        mesh = mesh_hsdp(2, 4, "cpu")
        self.assertEqual(mesh.mesh_dim_names, ("dp_replicate", "dp_shard"))
        self.assertEqual(tuple(mesh.shape), (2, 4))
        # Rank r sits at (r // 4, r % 4): shard groups are rows, replicate groups columns.
        self.assertEqual(
            mesh["dp_shard"].mesh.tolist(), [4 * (self.rank // 4) + i for i in range(4)]
        )
        self.assertEqual(mesh["dp_replicate"].mesh.tolist(), [self.rank % 4, self.rank % 4 + 4])

    def test_mesh_2x2x2(self):
        mesh = mesh_nd(2, 2, 2, "cpu")
        self.assertEqual(mesh.mesh_dim_names, ("dp_replicate", "dp_shard", "tp"))
        coordinate = (self.rank // 4, (self.rank // 2) % 2, self.rank % 2)
        self.assertEqual(list(mesh.get_coordinate()), list(coordinate))
        self.assertEqual(
            mesh["tp"].mesh.tolist(), [self.rank - self.rank % 2, self.rank - self.rank % 2 + 1]
        )
        self.assertEqual(mesh["dp_shard"].size(), 2)

    def test_mesh_dp_tp_4x2(self):
        mesh = mesh_dp_tp(4, 2, "cpu")
        self.assertEqual(mesh.mesh_dim_names, ("dp_shard", "tp"))
        self.assertEqual(tuple(mesh.shape), (4, 2))
        self.assertEqual(mesh["dp_shard"].mesh.tolist(), [self.rank % 2 + 2 * i for i in range(4)])

    def test_rejects_shapes_that_do_not_cover_the_world(self):
        with self.assertRaisesRegex(ValueError, "dp_replicate=3 x dp_shard=2 holds 6 ranks but"):
            mesh_hsdp(3, 2, "cpu")
        with self.assertRaisesRegex(ValueError, "holds 16 ranks but the world size is 8"):
            mesh_nd(2, 4, 2, "cpu")
        with self.assertRaisesRegex(ValueError, "'tp' must be a positive int, got 0"):
            mesh_dp_tp(8, 0, "cpu")

    def test_default_device_type_is_the_suites(self):
        self.assertEqual(mesh_1d().device_type, self.device_type)
