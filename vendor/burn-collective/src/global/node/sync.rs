use std::{
    marker::PhantomData,
    sync::{Arc, Mutex},
    vec,
};

use burn_communication::{CommunicationChannel, Message, Protocol, ProtocolClient};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, RwLock};

use crate::{NodeId, node::base::NodeState};

/// Handles the status of sync requests from other nodes
pub(crate) struct SyncService<P: Protocol> {
    /// Current node's state, shared with the thread that does aggregations
    node_state: Arc<RwLock<Option<NodeState>>>,
    /// The number of peers that have requested to sync with us since the last successful sync.
    syncing_peers: Mutex<Vec<NodeId>>,
    /// Notification on each incoming sync request
    sync_notif: Notify,

    _p: PhantomData<P>,
}

#[derive(Debug, Serialize, Deserialize)]
struct SyncRequest(NodeId);

impl<P: Protocol> SyncService<P> {
    pub fn new(node_state: Arc<RwLock<Option<NodeState>>>) -> Self {
        Self {
            node_state,
            syncing_peers: Mutex::new(vec![]),
            sync_notif: Notify::new(),
            _p: PhantomData,
        }
    }

    fn add_syncing_peer(&self, peer: NodeId) {
        let mut syncing_peers = self.syncing_peers.lock().unwrap();
        syncing_peers.push(peer);
    }

    /// Sync with all peers.
    pub async fn sync(&self) {
        // we can't sync while we register
        let node_state = self.node_state.read().await;
        let node_state = node_state
            .as_ref()
            .expect("Trying to sync a node before having registered to the orchestrator");

        // this peer is syncing
        self.add_syncing_peer(node_state.node_id);
        for (id, addr) in &node_state.nodes {
            if *id == node_state.node_id {
                continue;
            }

            let mut connection = P::Client::connect(addr.clone(), "sync")
                .await
                .expect("Couldn't connect to peer for sync");
            let msg = SyncRequest(node_state.node_id);
            let sync_bytes = rmp_serde::to_vec(&msg).unwrap();
            connection
                .send(Message::new(sync_bytes.into()))
                .await
                .expect("Peer closed connection unexpectedly");
            // Wait for the peer's acknowledgement: dropping the connection right after the send
            // can reset it before the peer has read the request, which then never arrives.
            let _ = connection.recv().await;
        }
        loop {
            // Registered before the check, so a request that lands in between still wakes it.
            let notified = self.sync_notif.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut syncing_peers = self.syncing_peers.lock().unwrap();
                let all_node_ids = node_state.nodes.keys().cloned().collect::<Vec<_>>();
                if all_node_ids.iter().all(|id| syncing_peers.contains(id)) {
                    // All nodes have reached this barrier: take one request of each, leaving
                    // those a faster peer already sent for the next one.
                    for id in &all_node_ids {
                        let at = syncing_peers.iter().position(|p| p == id).unwrap();
                        syncing_peers.remove(at);
                    }
                    return;
                }
            }
            // Wait for the next sync to come in
            notified.await
        }
    }

    pub async fn handle_sync_connection<C: CommunicationChannel>(&self, mut channel: C) {
        let msg = channel.recv().await.unwrap();
        let Some(msg) = msg else {
            return;
        };

        let msg = rmp_serde::from_slice::<SyncRequest>(&msg.data).unwrap();

        self.add_syncing_peer(msg.0);

        self.sync_notif.notify_waiters();
        // The acknowledgement the requesting node waits for before it closes the connection.
        let _ = channel.send(Message::new(vec![1u8].into())).await;
    }
}
